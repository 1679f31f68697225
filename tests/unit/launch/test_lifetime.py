"""Bounded lives and supervision: the restart policy (launch/restarts.py), the exit bound of an
orphan or a stopped process (process_life/lifetime.py), the loop watchdog (process_life/watchdog.py) and its
health page (process_life/loop_metrics.py), and the launcher backing off one crash-looping process
while the others serve. The processes are stand-ins: tests/lifetime_child.py,
tests/stand_in_serving.py, tests/stand_in_crashing.py."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from process_life import lifetime, watchdog
from launch.children import Child, reap, spawn
from process_life.loop_metrics import start_metrics_server
from launch.restarts import RestartPolicy, after_death
from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[3]
ENV = {k: v for k, v in os.environ.items() if k != lifetime.PARENT_ENV}


def delays(policy: RestartPolicy, lifetimes: list[float]) -> list[float | None]:
    """The delay before each restart (None: given up) for deaths after these lifetimes."""
    n, out = 0, []
    for lived in lifetimes:
        verdict = after_death(policy, n, lived)
        n = verdict.deaths_in_a_row
        out.append(verdict.delay_s)
    return out


@pytest.mark.parametrize("lifetimes, expected", [
    # Dying at once: 0.25 s doubling to the 30 s cap, given up at the 10th death in a row.
    ([0.1] * 10, [0.25, 0.5, 1, 2, 4, 8, 16, 30, 30, None]),
    # A life of 60 s (healthy_after_s) starts the count and the backoff afresh; 59.9 s does not.
    ([0.1, 0.1, 0.1, 60.0, 0.1], [0.25, 0.5, 1, 0.25, 0.5]),
    ([0.1, 0.1, 0.1, 59.9, 0.1], [0.25, 0.5, 1, 2, 4]),
    # One that dies after 30 s each time (a watchdog kill after a hang) is a crash loop too.
    ([30.0] * 10, [0.25, 0.5, 1, 2, 4, 8, 16, 30, 30, None]),
    # Healthy lives between deaths: never given up, never backed off.
    ([61.0] * 20, [0.25] * 20),
])
def test_the_backoff_schedule(lifetimes, expected):
    assert delays(RestartPolicy(), lifetimes) == expected


def test_give_up_after_0_never_gives_up_and_the_delay_stays_capped():
    assert delays(RestartPolicy(give_up_after=0), [0.1] * 30)[-3:] == [30, 30, 30]
    assert delays(RestartPolicy(give_up_after=3), [0.1] * 3) == [0.25, 0.5, None]


@pytest.mark.parametrize("name, stops_everything", [
    ("worker0", False), ("scheduler", True), ("gateway", True)])
def test_giving_up_stops_everything_only_for_the_scheduler_or_the_gateway(name, stops_everything,
                                                                         capsys):
    child = Child(name, [], proc=SimpleNamespace(returncode=3), started=99.9, deaths_in_a_row=2)
    why = reap(child, now=100.0, policy=RestartPolicy(give_up_after=3))
    assert (child.given_up, child.restart_at, child.deaths_in_a_row) == (True, None, 3)
    if stops_everything:
        assert why == (f"pagoda: {name} died 3 times in a row, each within 60 s of starting (last "
                       "exit code 3); giving up on it and stopping everything")
    else:
        assert why is None
        assert "giving up on it; the others keep serving" in capsys.readouterr().out


def test_a_death_before_giving_up_schedules_the_restart(capsys):
    child = Child("worker0", [], proc=SimpleNamespace(returncode=1), started=99.0, deaths_in_a_row=1)
    assert reap(child, now=100.0, policy=RestartPolicy()) is None
    assert (child.proc, child.restart_at, child.deaths_in_a_row, child.given_up) == (None, 100.5, 2, False)
    assert "restarting in 0.5 s" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["worker0", "scheduler"])
def test_a_child_that_refuses_its_flags_stops_everything_at_its_first_death(name, capsys):
    """Exit 2 (process_life/flag_errors.py): its next start would refuse them again."""
    child = Child(name, [], proc=SimpleNamespace(returncode=2), started=40.0)
    why = reap(child, now=100.0, policy=RestartPolicy())
    assert why == f"pagoda: {name} refused its flags (exit 2; why is above); stopping everything"
    assert (child.given_up, child.restart_at, child.last_code) == (True, None, 2)
    assert capsys.readouterr().out == ""


def test_the_health_page_answers_503_once_the_loop_stalls():
    port = free_port()
    server = start_metrics_server(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert urllib.request.urlopen(url, timeout=5).status == 200  # no tick yet: not armed
        watchdog.tick()
        assert urllib.request.urlopen(url, timeout=5).status == 200
        watchdog._last_tick = time.monotonic() - 6  # past STALE_AFTER_S
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == 503
    finally:
        watchdog._last_tick = None
        server.shutdown()


def child_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.lifetime_child", *args], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_launcher_starts_a_child_in_its_own_group_without_forking_itself():
    # LLM's process runs gRPC. A fork() (which a preexec_fn forces on subprocess) runs gRPC's fork
    # handlers, which restart its pollers in the child; those abort once the child closes the
    # descriptors it inherited (CI saw LLM's scheduler exit -6 that way). vfork() runs no fork
    # handlers, Python's own included: they stand witness here.
    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(1))
    proc = spawn([sys.executable, "-c", "import os; print(os.getpgid(0) == os.getpid())"], ENV,
                 stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=30)[0].strip() == "True"
    assert forks == []


@pytest.mark.integration
def test_an_orphan_whose_drain_is_wedged_exits_within_the_orphan_bound():
    # The witness makes itself a subreaper, so it can wait for the orphan and read its status.
    done = subprocess.run([sys.executable, "-m", "tests.lifetime_child", "witness"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=40)
    code, after = done.stdout.split()[-2:]
    bound = lifetime.ORPHAN_DRAIN_S + lifetime.MARGIN_S  # 5 s, not the child's 60 s drain
    assert int(code) == lifetime.EXIT_CODE, done.stdout + done.stderr
    assert bound - 0.5 < float(after) < bound + 1.0, done.stdout + done.stderr
    assert "the launcher (pid" in done.stderr and "is gone" in done.stderr


@pytest.mark.integration
def test_a_process_whose_drain_is_wedged_exits_within_drain_plus_margin_of_sigterm():
    proc = child_process("child", "1")
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert proc.stdout.readline().strip() == "draining"
        code = proc.wait(15)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    bound = 1 + lifetime.MARGIN_S
    assert code == lifetime.EXIT_CODE
    assert bound - 0.5 < took < bound + 1.0
    assert "still running 4 s after SIGTERM" in proc.stderr.read()


@pytest.mark.integration
def test_a_wedged_loop_exits_70_within_the_watchdog_timeout_with_its_stack():
    proc = child_process("wedge", "1")
    try:
        assert proc.stdout.readline().strip() == "wedging"
        wedged = time.monotonic()
        code = proc.wait(15)
        took = time.monotonic() - wedged
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert code == watchdog.EXIT_CODE, err
    assert 1.0 < took < 2.0
    assert "CRITICAL watchdog: the main loop" in err and "in wedged_turn" in err, err


@pytest.mark.integration
def test_a_loop_that_ticks_or_has_not_started_is_left_alone():
    proc = child_process("healthy", "1")  # 2 s before its first tick, then 2 s of ticks
    try:
        code = proc.wait(15)
    finally:
        proc.kill()
    assert (code, proc.stdout.read().strip(), proc.stderr.read()) == (0, "done", "")


def launcher(tmp_path: Path, *flags: str, **popen) -> subprocess.Popen:
    popen.setdefault("env", dict(ENV, PAGODA_STAND_IN_LOG=str(tmp_path / "stand-ins.log")))
    return subprocess.Popen([sys.executable, "-m", "launch", "--insecure", *flags], cwd=ROOT,
                            text=True, **popen)


def stand_ins(tmp_path: Path, worker_module: str, *flags: str) -> tuple[subprocess.Popen, Path]:
    """The launcher over serving stand-ins for the scheduler and the gateway, its output in a log."""
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        proc = launcher(tmp_path, "--scheduler-module", "tests.stand_in_serving", "--gateway-module",
                        "tests.stand_in_serving", "--worker-module", worker_module, *flags,
                        stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def notes(tmp_path: Path, what: str) -> list[tuple[int, float]]:
    path = tmp_path / "stand-ins.log"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(int(pid), float(t)) for w, pid, t in (ln.split() for ln in lines if ln) if w == what]


def wait_for(predicate, timeout_s: float) -> None:
    ends = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < ends, "timed out"
        time.sleep(0.05)


@pytest.mark.integration
def test_a_crash_looping_worker_is_backed_off_and_given_up_while_the_others_serve(tmp_path):
    proc, log = stand_ins(tmp_path, "tests.stand_in_crashing", "--crash-loop-deaths", "4")
    try:
        wait_for(lambda: "giving up on it; the others keep serving" in log.read_text(), 12)
        time.sleep(0.5)  # nothing else happens: no restart, no stop
        assert proc.poll() is None, log.read_text()
        serving = notes(tmp_path, "serving")
        assert len(serving) == 2 and all(os.kill(pid, 0) is None for pid, _ in serving)
        crashes = [t for _, t in notes(tmp_path, "crashed")]
        gaps = [b - a for a, b in zip(crashes, crashes[1:])]
        assert len(crashes) == 4, log.read_text()
        # Each gap is the backoff plus a start of the stand-in (well under 0.5 s).
        assert all(d <= gap < d + 0.5 for d, gap in zip([0.25, 0.5, 1.0], gaps)), gaps
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
    assert sorted(pid for pid, _ in notes(tmp_path, "stopped")) == sorted(p for p, _ in serving)
    assert "died 4 times in a row, each within 60 s of starting (last exit code 3)" in log.read_text()


@pytest.mark.integration
def test_giving_up_on_the_scheduler_stops_everything_with_exit_code_1(tmp_path):
    proc = launcher(tmp_path, "--scheduler-module", "tests.stand_in_crashing", "--gateway-module",
                    "tests.stand_in_serving", "--worker-module", "tests.stand_in_serving",
                    "--crash-loop-deaths", "3", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert ("pagoda: scheduler died 3 times in a row, each within 60 s of starting (last exit "
            "code 3); giving up on it and stopping everything") in out
    assert len(notes(tmp_path, "crashed")) == 3
    serving = sorted(pid for pid, _ in notes(tmp_path, "serving"))
    assert len(serving) == 2 and sorted(pid for pid, _ in notes(tmp_path, "stopped")) == serving


@pytest.mark.integration
def test_a_worker_that_refuses_its_flags_stops_everything_with_exit_code_2(tmp_path):
    proc = launcher(tmp_path, "--scheduler-module", "tests.stand_in_serving", "--gateway-module",
                    "tests.stand_in_serving", "--worker-module", "tests.stand_in_crashing",
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=dict(ENV, PAGODA_STAND_IN_LOG=str(tmp_path / "stand-ins.log"), PAGODA_STAND_IN_EXIT="2"))
    try:
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 2, out
    assert "pagoda: worker0 refused its flags (exit 2; why is above); stopping everything" in out
    assert len(notes(tmp_path, "crashed")) == 1 and "restarting" not in out
    serving = sorted(pid for pid, _ in notes(tmp_path, "serving"))
    assert len(serving) == 2 and sorted(pid for pid, _ in notes(tmp_path, "stopped")) == serving


@pytest.mark.integration
def test_a_stopped_worker_is_killed_and_restarted(tmp_path):
    """A SIGSTOPped worker keeps its process but does nothing: the scheduler drops it, and the
    launcher kills it after --stopped-timeout so that a fresh one takes its place."""
    proc, log = stand_ins(tmp_path, "tests.stand_in_serving", "--stopped-timeout", "1")
    try:
        wait_for(lambda: len(notes(tmp_path, "serving")) == 3, 10)
        worker = int(re.search(r"started worker0 \(pid (\d+)\)", log.read_text()).group(1))
        os.kill(worker, signal.SIGSTOP)
        wait_for(lambda: len(notes(tmp_path, "serving")) == 4, 10)
        assert "pagoda: worker0 has been stopped (SIGSTOP) for 1 s; killing it" in log.read_text()
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()


@pytest.mark.integration
def test_a_launcher_whose_supervisor_dies_stops_its_children(tmp_path):
    """A test's or a benchmark's Cluster names itself to the launcher (PARENT_ENV): when it is
    killed before it can stop the stack, the launcher stops everything in order by itself."""
    launch = [sys.executable, "-m", "launch", "--insecure", "--scheduler-module",
              "tests.stand_in_serving", "--gateway-module", "tests.stand_in_serving",
              "--worker-module", "tests.stand_in_serving"]
    script = ("import os, subprocess, sys, time; "
              f"p = subprocess.Popen({launch!r}, env=dict(os.environ, {lifetime.PARENT_ENV}=str(os.getpid()))); "
              "print(p.pid, flush=True); time.sleep(600)")
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                                  env=dict(ENV, PAGODA_STAND_IN_LOG=str(tmp_path / "stand-ins.log")))
    launcher_pid = int(supervisor.stdout.readline())
    try:
        wait_for(lambda: len(notes(tmp_path, "serving")) == 3, 20)
        supervisor.kill()
        wait_for(lambda: len(notes(tmp_path, "stopped")) == 3, 15)
    finally:
        supervisor.kill()
        for pid in [launcher_pid] + [p for p, _ in notes(tmp_path, "serving")]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert sorted(p for p, _ in notes(tmp_path, "stopped")) == sorted(p for p, _ in notes(tmp_path, "serving"))
