"""`python -m launch [flags]` (what `make run` calls): a scheduler, N workers and a gateway on
loopback, until Ctrl-C or SIGTERM stops them: the gateway first (it drains its streams), then the
scheduler, then the workers, each waited for.

Restarts are per process (launch/restarts.py): one that dies is started again after a backoff
of 0.25 s that doubles with each death in a row, up to 30 s, while the others keep running and
reconnect to it by themselves; one that had lived --crash-loop-window seconds (60) starts its
count afresh. At its --crash-loop-deaths-th death in a row (10) the launcher gives up on that
process alone: a worker given up on is logged and the rest keep serving; giving up on the
scheduler or the gateway, without which nothing is served, stops everything with exit code 1.

Each child has a bounded life of its own (launch/lifetime.py): it exits within its drain plus a
few seconds of SIGTERM, and within a few seconds of this launcher's death, even with its loop
wedged; and a watchdog (launch/watchdog.py, --watchdog-timeout) makes one whose loop has stopped
turning exit with code 70, which the backoff above then restarts.

Each flag goes to every process whose parser knows it, so `--max-num-seqs 8` reaches the
scheduler, `--num-gpu-blocks-override 64` the workers, and an address flag both ends of its
socket. The launcher itself owns --num-workers, the --*-module flags and the crash-loop flags.
Unless --zmq-keys-dir or --insecure is given, it creates a CURVE key set in .cache/zmq-keys on
first use and hands it to every process.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launch import watchdog
from launch.lifetime import PARENT_ENV
from launch.restarts import RestartPolicy, after_death

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KEYS_DIR = ROOT / ".cache" / "zmq-keys"


def process_parsers() -> dict[str, argparse.ArgumentParser]:
    # Only the flag definitions are imported here: none of these modules loads torch at import.
    from gateway.args import add_gateway_args
    from scheduler.args import add_scheduler_args
    from worker.args import add_worker_args
    # --watchdog-timeout is added by each process's main() (launch/watchdog.py), not its args.py.
    return {
        "scheduler": watchdog.add_flag(add_scheduler_args(argparse.ArgumentParser(add_help=False)),
                                       watchdog.LOOP_TIMEOUT_S),
        "worker": watchdog.add_flag(add_worker_args(argparse.ArgumentParser(add_help=False)),
                                    watchdog.WORKER_TIMEOUT_S),
        "gateway": watchdog.add_flag(add_gateway_args(argparse.ArgumentParser(add_help=False)),
                                     watchdog.LOOP_TIMEOUT_S),
    }


def route_flags(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """Split argv into one argument list per process. Unknown flags are an error, not ignored."""
    routed: dict[str, list[str]] = {name: [] for name in parsers}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise SystemExit(f"pagoda: unexpected argument {token!r}")
        flag, has_value, _ = token.partition("=")
        owners = [n for n, p in parsers.items() if flag in p._option_string_actions]
        if not owners:
            raise SystemExit(f"pagoda: unknown flag {flag}")
        action = parsers[owners[0]]._option_string_actions[flag]
        takes_value = action.nargs != 0 and not has_value
        tokens = argv[i:i + 2] if takes_value else [token]
        if takes_value and len(tokens) < 2:
            raise SystemExit(f"pagoda: {flag} needs a value")
        for name in owners:
            routed[name] += tokens
        i += len(tokens)
    return routed


def with_keys(argv: list[str], keys_dir: Path = DEFAULT_KEYS_DIR) -> list[str]:
    """argv with --zmq-keys-dir added (the key set created on first use) unless it chooses its
    own keys or --insecure."""
    if any(f.split("=")[0] in ("--zmq-keys-dir", "--insecure") for f in argv):
        return argv
    from proto.auth import create_keys
    return [*argv, "--zmq-keys-dir", str(create_keys(keys_dir))]


def module_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


# The children's own bounds (launch/lifetime.py) come first: 3 s for the scheduler, 8 s for a
# worker, the grace period plus 3 s for the gateway.
STOP_WAIT_S = 10.0  # for the scheduler and each worker; the gateway gets its grace period more
ESSENTIAL = ("scheduler", "gateway")  # giving up on one of these stops everything


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    deaths_in_a_row: int = 0
    restart_at: float | None = None
    given_up: bool = False
    stopped_since: float | None = None  # SIGSTOPped (state T) since, by the last look


def kill_if_stopped_too_long(child: Child, now: float, timeout_s: float) -> None:
    """SIGKILL a child that has stayed stopped (state T) for timeout_s; reap() restarts it."""
    if not is_stopped(child.proc.pid):
        child.stopped_since = None
    elif child.stopped_since is None:
        child.stopped_since = now
    elif now - child.stopped_since > timeout_s:
        print(f"pagoda: {child.name} has been stopped (SIGSTOP) for {timeout_s:g} s; killing it "
              "so that it is restarted", flush=True)
        child.proc.kill()
        child.stopped_since = None


def is_stopped(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("T")  # the state follows the command's ")"


def own_group_and_die_with_parent() -> None:
    # A process group of its own: Ctrl-C reaches the launcher only, which stops the others in
    # order. PR_SET_PDEATHSIG: a launcher killed with -9 still takes its children along.
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def spawn(cmd: list[str], env: dict, **popen) -> subprocess.Popen:
    """A child as the launcher starts one: in its own process group, sent SIGTERM when the
    launcher dies, and told the launcher's pid (PARENT_ENV), by which it notices it is orphaned
    even when that SIGTERM never came."""
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, PARENT_ENV: str(os.getpid())},
                            preexec_fn=own_group_and_die_with_parent, **popen)


def start(child: Child, env: dict) -> None:
    child.proc = spawn(child.cmd, env)
    child.started, child.restart_at = time.monotonic(), None
    print(f"pagoda: started {child.name} (pid {child.proc.pid}): {' '.join(child.cmd[2:])}",
          flush=True)


def reap(child: Child, now: float, policy: RestartPolicy) -> str | None:
    """child has exited: schedule its restart or give up on it; says why everything must stop
    when it was the scheduler or the gateway that was given up on."""
    code, lived = child.proc.returncode, now - child.started
    child.proc = None
    verdict = after_death(policy, child.deaths_in_a_row, lived)
    child.deaths_in_a_row = verdict.deaths_in_a_row
    if verdict.delay_s is not None:
        child.restart_at = now + verdict.delay_s
        print(f"pagoda: {child.name} exited with {code} after {lived:.1f} s (death "
              f"{verdict.deaths_in_a_row} in a row); restarting in {verdict.delay_s:g} s",
              flush=True)
        return None
    child.given_up = True
    why = (f"pagoda: {child.name} died {verdict.deaths_in_a_row} times in a row, each within "
           f"{policy.healthy_after_s:g} s of starting (last exit code {code}); giving up on it")
    if child.name in ESSENTIAL:
        return f"{why} and stopping everything"
    print(f"{why}; the others keep serving", flush=True)
    return None


def stop_in_order(children: list[Child], gateway_grace: float) -> None:
    """Gateway (drains its streams), then scheduler, then workers; SIGKILL for one that outstays
    its wait."""
    groups = [([c for c in children if c.name == "gateway"], gateway_grace + STOP_WAIT_S),
              ([c for c in children if c.name == "scheduler"], STOP_WAIT_S),
              ([c for c in children if c.name.startswith("worker")], STOP_WAIT_S)]
    for group, wait in groups:
        live = [c for c in group if c.proc is not None and c.proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pagoda: {c.name} did not stop within {wait:g} s; killing it", flush=True)
                c.proc.kill()
                c.proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser("pagoda", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--num-workers", type=int, default=1)
    for name, default in (("scheduler", "scheduler.main"), ("worker", "worker.main"),
                          ("gateway", "gateway.main")):
        # Tests run stand-ins: tests.fake_worker_main, tests/stand_in_*.py.
        own.add_argument(f"--{name}-module", default=default,
                         help=f"the module each {name} runs (default: %(default)s)")
    defaults = RestartPolicy()
    own.add_argument("--crash-loop-deaths", type=int, default=defaults.give_up_after,
                     help="deaths of one process in a row, each soon after its start, after which "
                          "the launcher gives up on it (and stops everything if it is the "
                          "scheduler or the gateway); 0 = never (default: %(default)s)")
    own.add_argument("--crash-loop-window", type=float, default=defaults.healthy_after_s,
                     help="seconds after its start within which a death counts as one more in "
                          "a crash loop; a process that lives longer starts the count and its "
                          "backoff afresh (default: %(default)s)")
    own.add_argument("--stopped-timeout", type=float, default=10.0,
                     help="a child stopped (SIGSTOP, state T) this many seconds is killed, and so "
                          "restarted: the scheduler has dropped it as silent by then, and a "
                          "stopped process would hold its place forever (0 = never) "
                          "(default: %(default)s)")
    opts, rest = own.parse_known_args(argv)
    parsers = process_parsers()
    routed = route_flags(with_keys(rest), parsers)
    gateway_grace = parsers["gateway"].parse_args(routed["gateway"]).shutdown_grace_period
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
                    code = 1
                    stopping.append(True)
                    break
            elif child.proc is None and child.restart_at is not None and now >= child.restart_at:
                start(child, env)
            elif child.proc is not None and opts.stopped_timeout:
                kill_if_stopped_too_long(child, now, opts.stopped_timeout)
        time.sleep(0.1)
    print("pagoda: stopping: gateway, then scheduler, then workers", flush=True)
    stop_in_order(children, gateway_grace)
    return code


if __name__ == "__main__":
    sys.exit(main())
