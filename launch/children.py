"""The launcher's children: how one is started (its own process group, told the launcher's pid,
SIGTERM when the launcher dies), what happens when one exits (a restart after a backoff, or
giving up on it: launch/restarts.py), and the stop in order."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from process_life.flag_errors import BAD_FLAGS
from process_life.lifetime import PARENT_ENV
from launch.restarts import RestartPolicy, after_death

ROOT = Path(__file__).resolve().parent.parent  # the children's working directory


def module_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


# The children's own bounds (process_life/lifetime.py) come first: 3 s for the scheduler, 8 s for a
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
    last_code: int | None = None  # its last exit code


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


def spawn(cmd: list[str], env: dict, **popen) -> subprocess.Popen:
    """A child as the launcher starts one: in a process group of its own (Ctrl-C reaches the
    launcher only, which stops the others in order), and told the launcher's pid (PARENT_ENV):
    the child then asks for SIGTERM when the launcher dies, and notices it is orphaned even when
    that SIGTERM never came (process_life/lifetime.py). No preexec_fn: subprocess would fork() this
    process instead of vfork(), and gRPC's fork handlers can abort the child (LLM's process
    has gRPC running)."""
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, PARENT_ENV: str(os.getpid())},
                            process_group=0, **popen)


def start(child: Child, env: dict) -> None:
    child.proc = spawn(child.cmd, env)
    child.started, child.restart_at = time.monotonic(), None
    print(f"pagoda: started {child.name} (pid {child.proc.pid}): {' '.join(child.cmd[2:])}",
          flush=True)


def reap(child: Child, now: float, policy: RestartPolicy) -> str | None:
    """child has exited: schedule its restart or give up on it; says why everything must stop
    when it was the scheduler or the gateway that was given up on."""
    code, lived = child.proc.returncode, now - child.started
    child.proc, child.last_code = None, code
    if code == BAD_FLAGS:  # its flags will be as wrong on every restart, and every worker has them
        child.given_up = True
        return f"pagoda: {child.name} refused its flags (exit {code}; why is above); stopping everything"
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
