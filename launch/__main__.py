"""`python -m launch [flags]` (what `make run` calls): a scheduler, N workers and a gateway on
loopback, until Ctrl-C stops all of them.

Each flag goes to every process whose parser knows it, so `--max-num-seqs 8` reaches the
scheduler, `--num-gpu-blocks-override 64` the workers, and an address flag both ends of its
socket. The launcher itself owns only --num-workers. Unless --zmq-keys-dir or --insecure is
given, it creates a CURVE key set in .cache/zmq-keys on first use and hands it to every process.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KEYS_DIR = ROOT / ".cache" / "zmq-keys"


def process_parsers() -> dict[str, argparse.ArgumentParser]:
    # Only the flag definitions are imported here: none of these modules loads torch at import.
    from gateway.args import add_gateway_args
    from scheduler.args import add_scheduler_args
    from worker.args import add_worker_args
    return {
        "scheduler": add_scheduler_args(argparse.ArgumentParser(add_help=False)),
        "worker": add_worker_args(argparse.ArgumentParser(add_help=False)),
        "gateway": add_gateway_args(argparse.ArgumentParser(add_help=False)),
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser("pagoda", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--num-workers", type=int, default=1)
    opts, rest = own.parse_known_args(argv)
    routed = route_flags(with_keys(rest), process_parsers())

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    commands = [("scheduler", module_command("scheduler.main", routed["scheduler"]))]
    commands += [(f"worker{i}", module_command("worker.main", routed["worker"]))
                 for i in range(opts.num_workers)]
    commands.append(("gateway", module_command("gateway.main", routed["gateway"])))
    procs = []
    for name, cmd in commands:
        print(f"pagoda: starting {name}: {' '.join(cmd[2:])}", flush=True)
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env)))

    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code, lost = 0, set()
    while not stopping:
        for name, p in procs:
            if p.poll() is None or name in lost:
                continue
            if name.startswith("worker"):
                # The scheduler recomputes a lost worker's sequences on the others; serve on.
                print(f"pagoda: {name} exited with {p.returncode}; serving with the rest", flush=True)
                lost.add(name)
            else:
                print(f"pagoda: {name} exited with {p.returncode}; stopping the rest", flush=True)
                code = p.returncode or 1
                stopping = True
                break
        time.sleep(0.2)
    shutdown([p for _, p in procs])
    return code


def shutdown(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGINT first (each process cleans up), SIGKILL for any that outstays the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
