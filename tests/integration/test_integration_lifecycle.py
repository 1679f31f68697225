"""The launcher's cluster survives the death of any one process, stops in order, and a gateway
drains its streams on SIGTERM; a poisoned sequence fails alone. Real processes on loopback, with
the fake worker (tests/fake_worker_main.py) standing in for the model: these faults are about
processes, not about what the model computes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import ROOT, Cluster, free_port, wait_for
from tests.fake_worker import POISON_MARK, reference_output

pytestmark = pytest.mark.integration

# A plan sent to a worker in the instant it is killed is lost with it; the scheduler notices the
# silence after this long (faster detection is docs/faults.md's "Liveness").
WORKER_TIMEOUT_S = 3
FAKE = ("--worker-module", "tests.fake_worker_main", "--num-gpu-blocks-override", "1024",
        "--worker-timeout", str(WORKER_TIMEOUT_S), "--shutdown-grace-period", "20")
STEP_S = "0.02"  # each fake step sleeps this long, so that 150 tokens take about 3 s
RECOVERY_BOUND_S = 30.0
SEED = 7  # the fake model draws from the seed the gateway sends (one is always sent)


def fake_cluster(tmp_path, *flags: str, num_workers: int = 2) -> Cluster:
    os.environ["PAGODA_FAKE_STEP_S"] = STEP_S
    try:
        return Cluster(*FAKE, *flags, num_workers=num_workers, log_path=tmp_path / "cluster.log").start(60)
    finally:
        del os.environ["PAGODA_FAKE_STEP_S"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = fake_cluster(tmp_path_factory.mktemp("lifecycle"))
    assert c.wait_for_workers(2, 30)
    yield c
    assert c.stop() == 0, c.log_tail()


def pid_of(cluster: Cluster, name: str) -> int:
    """The latest pid the launcher reported for a process."""
    pids = re.findall(rf"pagoda: started {name} \(pid (\d+)\)", cluster.log_path.read_text())
    return int(pids[-1])


def prompt(i: int) -> list[int]:
    return [11 + i, 12, 13, 14 + i, 15]


def request(tokens: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=tokens, sampling=pb.SamplingParams(temperature=0, seed=SEED),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def stream(stub, req: pb.GenerateRequest, out: dict, key, first_token: threading.Event | None = None):
    tokens = []
    try:
        for msg in stub.GenerateStream(req, timeout=120):
            tokens += list(msg.token_ids)
            if first_token is not None and tokens:
                first_token.set()
        out[key] = ("OK", tokens, time.monotonic())
    except grpc.RpcError as e:
        out[key] = (e.code().name, e.details(), time.monotonic())


@contextmanager
def eight_streams_under_way(cluster: Cluster):
    """Eight streams of 150 tokens, each with its first token: yields `out`, where `stream` puts
    each one's outcome as it ends; leaving waits for them (up to 60 s each)."""
    reqs = [request(prompt(i), 150) for i in range(8)]
    out: dict = {}
    started = [threading.Event() for _ in reqs]
    with grpc.insecure_channel(cluster.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        threads = [threading.Thread(target=stream, args=(stub, r, out, i, started[i]))
                   for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        yield out
        for t in threads:
            t.join(60)


def new_request_succeeds_within(cluster: Cluster, bound: float) -> float:
    """Seconds until a new request completes (each failed try is retried), or fail at bound."""
    start = time.monotonic()
    req = request(prompt(0), 8)
    last = None
    while time.monotonic() - start < bound:
        try:
            with grpc.insecure_channel(cluster.target) as ch:
                # A request sent in the instant the scheduler died is lost with it (the gateway
                # ends such calls once it notices, see docs/faults.md); try again soon.
                got = pagoda_pb2_grpc.GenerationStub(ch).Generate(req, timeout=2)
            assert list(got.token_ids) == reference_output(prompt(0), 8, seed=SEED)
            return time.monotonic() - start
        except grpc.RpcError as e:
            last = e.code().name
            time.sleep(0.2)
    raise AssertionError(f"no request succeeded within {bound} s (last: {last})\n{cluster.log_tail()}")


@pytest.mark.parametrize("name", ["scheduler", "gateway", "worker0"])
def test_kill_9_of_any_one_process_is_survived(cluster, name):
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)
    old = pid_of(cluster, name)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    recovery = new_request_succeeds_within(cluster, RECOVERY_BOUND_S)
    assert wait_for(lambda: pid_of(cluster, name) != old, RECOVERY_BOUND_S)  # started again
    restarted = time.monotonic() - killed
    print(f"\nkill -9 {name}: a new request succeeded {recovery:.2f} s later; restarted within "
          f"{restarted:.2f} s")
    assert cluster.proc.poll() is None


def test_sigterm_to_the_gateway_lets_8_streams_finish_token_exact(cluster):
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)
    with eight_streams_under_way(cluster) as out:
        gateway = pid_of(cluster, "gateway")
        os.kill(gateway, signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        # Draining: health says NOT_SERVING (or the port already refuses), new calls UNAVAILABLE.
        with grpc.insecure_channel(cluster.target) as fresh:
            try:
                health = health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=2)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as refused:
                pagoda_pb2_grpc.GenerationStub(fresh).Generate(request(prompt(0), 4), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [out[i][0] for i in range(8)] == ["OK"] * 8, out
    assert [out[i][1] for i in range(8)] == [reference_output(prompt(i), 150, seed=SEED) for i in range(8)]
    drained = max(out[i][2] for i in range(8)) - sent
    print(f"\nSIGTERM to the gateway: 8 streams finished token-exact {drained:.2f} s later "
          "(grace 20 s)")
    assert drained < 20
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)  # the launcher started another


def test_a_poisoned_sequence_ends_internal_and_7_others_finish_exact(cluster):
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)
    prompts = [prompt(i) for i in range(7)] + [[POISON_MARK, 5, 21, 22, 23]]
    out: dict = {}
    with grpc.insecure_channel(cluster.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        threads = [threading.Thread(target=stream, args=(stub, request(p, 60), out, i))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    code, message, _ = out[7]
    assert code == "INTERNAL"
    assert len(message) < 100 and "Poison" not in message and "Traceback" not in message, message
    for i in range(7):
        assert out[i][:2] == ("OK", reference_output(prompts[i], 60, seed=SEED)), i
    print(f"\npoisoned sequence: INTERNAL {message!r}; 7 others token-exact")


def test_a_worker_given_sigterm_says_goodbye_and_its_streams_continue_at_once(cluster):
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)
    with eight_streams_under_way(cluster) as out:
        os.kill(pid_of(cluster, "worker1"), signal.SIGTERM)
        sent = time.monotonic()
        assert wait_for(lambda: "dropped (said goodbye)" in cluster.log_path.read_text(), 10)
        requeued = time.monotonic() - sent
    assert [out[i][:2] for i in range(8)] == [("OK", reference_output(prompt(i), 150, seed=SEED)) for i in range(8)]
    took = max(out[i][2] for i in range(8)) - sent
    print(f"\nSIGTERM to a worker: its sequences were requeued {requeued:.2f} s later (goodbye, "
          f"not the {WORKER_TIMEOUT_S} s timeout); all 8 streams finished token-exact {took:.2f} s later")
    assert requeued < WORKER_TIMEOUT_S


def test_the_launcher_stops_gateway_then_scheduler_then_workers(tmp_path):
    c = fake_cluster(tmp_path, num_workers=1)
    assert c.stop() == 0
    log = c.log_path.read_text()
    gateway, scheduler, worker = (log.index("gateway: stopped after"), log.index("scheduler stopped"),
                                  log.index("saying goodbye"))
    assert gateway < scheduler < worker, log[-3000:]


def test_a_scheduler_that_keeps_dying_at_start_stops_everything(tmp_path):
    """A worker given up on leaves the rest serving (tests/unit/launch/test_lifetime.py); the scheduler or
    the gateway given up on stops the launcher with exit 1."""
    flags = ["--scheduler-module", "tests.no_such_module", "--crash-loop-deaths", "3",
             "--port", str(free_port()), "--scheduler-gateway-address", f"tcp://127.0.0.1:{free_port()}",
             "--scheduler-worker-address", f"tcp://127.0.0.1:{free_port()}",
             "--scheduler-metrics-port", "0", "--gateway-metrics-port", "0"]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "launch", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    took = time.monotonic() - start
    assert done.returncode == 1
    assert "scheduler died 3 times in a row" in done.stdout, done.stdout + done.stderr
    assert "pagoda: stopping: gateway, then scheduler, then workers" in done.stdout
    print(f"\ncrash loop: the launcher gave up after {took:.1f} s")


def test_flags_only_the_real_worker_can_check_stop_the_stack_at_once_with_exit_code_2(tmp_path):
    """The launcher checks what it can before it starts (tests/unit/launch/test_launch.py); a
    combination that only a worker's start finds wrong ends it the same way, not in restarts."""
    c = Cluster("--quantization", "q4_1", "--dtype", "bfloat16", log_path=tmp_path / "cluster.log")
    with pytest.raises(RuntimeError, match="launcher exited with 2"):
        c.start(120)
    log = c.log_path.read_text()
    assert log.count("pagoda: --quantization q4_1 runs on the CPU, with --dtype float32, on one rank") == 1
    assert "pagoda: worker0 refused its flags (exit 2; why is above); stopping everything" in log
    assert "restarting" not in log and "Traceback" not in log


def test_the_compose_health_probe_reads_the_gateway_and_the_scheduler(cluster):
    new_request_succeeds_within(cluster, RECOVERY_BOUND_S)

    def probe(target: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launch.healthcheck", target], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
    serving = probe(f"grpc://{cluster.target}")
    assert (serving.returncode, serving.stdout.split()[-1]) == (0, "SERVING")
    assert probe(f"http://127.0.0.1:{cluster.metrics_port}/metrics").returncode == 0
    nobody = probe(f"grpc://127.0.0.1:{free_port()}")
    assert (nobody.returncode, nobody.stdout.split()[-1]) == (1, "UNAVAILABLE")
