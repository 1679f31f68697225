"""Which flags go to which process: each process's parser (only the flag definitions are
imported), and the routing of one command line to all of them. Each flag goes to every process
whose parser knows it, so `--max-num-seqs 8` reaches the scheduler and the workers and an address
flag both ends of its socket; a flag none knows is an error."""
from __future__ import annotations

import argparse
from pathlib import Path

from process_life import watchdog
from launch.children import ROOT
from process_life.flag_errors import FlagError

DEFAULT_KEYS_DIR = ROOT / ".cache" / "zmq-keys"


def process_parsers() -> dict[str, argparse.ArgumentParser]:
    # Only the flag definitions are imported here: none of these modules loads torch at import.
    from gateway.gateway_flags import add_gateway_args
    from scheduler.scheduler_flags import add_scheduler_args
    from worker.worker_flags import add_worker_args
    # --watchdog-timeout is added by each process's main() (process_life/watchdog.py), not its flags.
    return {
        "scheduler": watchdog.add_flag(add_scheduler_args(argparse.ArgumentParser(add_help=False)),
                                       watchdog.LOOP_TIMEOUT_S),
        "worker": watchdog.add_flag(add_worker_args(argparse.ArgumentParser(add_help=False)),
                                    watchdog.WORKER_TIMEOUT_S),
        "gateway": watchdog.add_flag(add_gateway_args(argparse.ArgumentParser(add_help=False)),
                                     watchdog.LOOP_TIMEOUT_S),
    }


def route_flags(argv: list[str], parsers: dict[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """Split argv into one argument list per process. Unknown flags are an error (FlagError),
    not ignored."""
    routed: dict[str, list[str]] = {name: [] for name in parsers}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise FlagError(f"unexpected argument {token!r}")
        flag, has_value, _ = token.partition("=")
        owners = [n for n, p in parsers.items() if flag in p._option_string_actions]
        if not owners:
            raise FlagError(f"unknown flag {flag}")
        action = parsers[owners[0]]._option_string_actions[flag]
        takes_value = action.nargs != 0 and not has_value
        tokens = argv[i:i + 2] if takes_value else [token]
        if takes_value and len(tokens) < 2:
            raise FlagError(f"{flag} needs a value")
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


def check_flags(routed: dict[str, list[str]], parsers: dict[str, argparse.ArgumentParser],
                stand_ins: bool = False) -> dict[str, argparse.Namespace]:
    """Each process's flags parsed as that process will parse them, before anything starts: a
    bad value is a FlagError here with argparse's message (and not the usage of dozens of
    flags), where each worker would otherwise exit with it in turn. The model files a worker and
    the gateway will look for must be there too, and the model must have been trained on
    --max-model-len positions, unless stand-ins (tests' --*-module) run in their place."""
    args = {}
    for name, parser in parsers.items():
        parser.exit_on_error = False
        try:
            args[name] = parser.parse_args(routed[name])
        except argparse.ArgumentError as e:
            raise FlagError(str(e)) from None
    if not stand_ins:
        from worker.worker_flags import model_refusal
        if why := model_refusal(args["worker"]):
            raise FlagError(why)
    return args
