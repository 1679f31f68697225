"""`python -m launch [flags]` (what `make run` calls): a scheduler, N workers and a gateway on
loopback, until Ctrl-C or SIGTERM stops them: the gateway first (it drains its streams), then the
scheduler, then the workers, each waited for.

Restarts are per process (launch/restarts.py): one that dies is started again after a backoff
of 0.25 s that doubles with each death in a row, up to 30 s, while the others keep running and
reconnect to it by themselves; one that had lived --crash-loop-window seconds (60) starts its
count afresh. At its --crash-loop-deaths-th death in a row (10) the launcher gives up on that
process alone: a worker given up on is logged and the rest keep serving; giving up on the
scheduler or the gateway, without which nothing is served, stops everything with exit code 1.
Flags are checked before anything starts (launch/flag_routing.py check_flags), and a child that
exits 2 refused its flags (process_life/flag_errors.py): that stops everything at once, with exit 2.

Each child has a bounded life of its own (process_life/lifetime.py): it exits within its drain plus a
few seconds of SIGTERM, and within a few seconds of this launcher's death, even with its loop
wedged; and a watchdog (process_life/watchdog.py, --watchdog-timeout) makes one whose loop has stopped
turning exit with code 70, which the backoff above then restarts.

Each flag goes to every process whose parser knows it, so `--max-num-seqs 8` reaches the
scheduler, `--num-gpu-blocks-override 64` the workers, and an address flag both ends of its
socket. The launcher itself owns --num-workers, the --*-module flags and the crash-loop flags.
Unless --zmq-keys-dir or --insecure is given, it creates a CURVE key set in .cache/zmq-keys on
first use and hands it to every process.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from launch.children import (Child, kill_if_stopped_too_long, module_command, reap, start,
                             stop_in_order)
from process_life import lifetime
from process_life.flag_errors import BAD_FLAGS
from process_life.flag_types import COUNT, POSITIVE_SECONDS, SECONDS, int_at_least
from launch.flag_routing import check_flags, process_parsers, route_flags, with_keys
from process_life.lifetime import PARENT_ENV
from launch.restarts import RestartPolicy


def launcher_parser() -> argparse.ArgumentParser:
    """The launcher's own flags; the rest of a command line goes to the processes."""
    own = argparse.ArgumentParser("pagoda", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--num-workers", type=COUNT, default=1)
    for name, default in (("scheduler", "scheduler.main"), ("worker", "worker.main"),
                          ("gateway", "gateway.main")):
        # Tests run stand-ins: tests.fake_worker_main, tests/stand_in_*.py.
        own.add_argument(f"--{name}-module", default=default,
                         help=f"the module each {name} runs (default: %(default)s)")
    defaults = RestartPolicy()
    own.add_argument("--crash-loop-deaths", type=int_at_least(0), default=defaults.give_up_after,
                     help="deaths of one process in a row, each soon after its start, after which "
                          "the launcher gives up on it (and stops everything if it is the "
                          "scheduler or the gateway); 0 = never (default: %(default)s)")
    own.add_argument("--crash-loop-window", type=POSITIVE_SECONDS, default=defaults.healthy_after_s,
                     help="seconds after its start within which a death counts as one more in "
                          "a crash loop; a process that lives longer starts the count and its "
                          "backoff afresh (default: %(default)s)")
    own.add_argument("--stopped-timeout", type=SECONDS, default=10.0,
                     help="a child stopped (SIGSTOP, state T) this many seconds is killed, and so "
                          "restarted: the scheduler has dropped it as silent by then, and a "
                          "stopped process would hold its place forever (0 = never) "
                          "(default: %(default)s)")
    return own


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = launcher_parser().parse_known_args(argv)
    parsers = process_parsers()
    routed = route_flags(with_keys(rest), parsers)
    stand_ins = (opts.worker_module, opts.gateway_module) != ("worker.main", "gateway.main")
    gateway_grace = check_flags(routed, parsers, stand_ins)["gateway"].shutdown_grace_period
    policy = RestartPolicy(healthy_after_s=opts.crash_loop_window,
                           give_up_after=opts.crash_loop_deaths)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    children = [Child("scheduler", module_command(opts.scheduler_module, routed["scheduler"]))]
    children += [Child(f"worker{i}", module_command(opts.worker_module, routed["worker"]))
                 for i in range(opts.num_workers)]
    children.append(Child("gateway", module_command(opts.gateway_module, routed["gateway"])))

    stopping = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # Started by a supervisor that named itself (a test's or a benchmark's Cluster): stop in
    # order when it dies, however it dies, rather than serve on with nobody to stop us.
    supervisor = env.pop(PARENT_ENV, "")
    if supervisor.isdigit():
        lifetime.die_with_parent(signal.SIGTERM)
    for child in children:
        start(child, env)
    code = 0
    while not stopping:
        now = time.monotonic()
        for child in children:
            if child.proc is not None and child.proc.poll() is not None:
                why = reap(child, now, policy)
                if why is not None:
                    print(why, flush=True)
                    code = BAD_FLAGS if child.last_code == BAD_FLAGS else 1
                    stopping.append(True)
                    break
            elif child.proc is None and child.restart_at is not None and now >= child.restart_at:
                start(child, env)
            elif child.proc is not None and opts.stopped_timeout:
                kill_if_stopped_too_long(child, now, opts.stopped_timeout)
        if supervisor.isdigit() and os.getppid() != int(supervisor):
            stopping.append(True)  # it died before prctl took hold
        time.sleep(0.1)
    print("pagoda: stopping: gateway, then scheduler, then workers", flush=True)
    stop_in_order(children, gateway_grace)
    return code
