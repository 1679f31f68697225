"""Hostile clients against the gateway's grammar check, on the real stack (scheduler, gateway
with its real compiler children, a fake worker: the model is not the point). A JSON schema whose
pattern is a long bounded repetition takes xgrammar seconds to compile (^[a-z]{1,20000}$: 17.7 s
for SmolLM2's vocabulary), and each such spec is distinct by its bound, so no cache saves the
compile. Tenant A floods them; tenant B's structured request still compiles within the wait
bound, B's plain stream stays token-exact, A's flood ends in 400s (the compile bound) and 429s
(the wait bound), health answers within 1 s throughout and the gateway grows by less than
100 MB. The last test SIGKILLs the gateway:
its compiler children die with it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster, children, rss_bytes
from tests.fake_worker import reference_output
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
COMPILE_S = 1.0   # --max-grammar-compile-seconds
# --max-grammar-queue-seconds: above COMPILE_S, the longest A's slow spec holds a child that B
# then takes (a timeout costs no restart: the child compiles in a fork it kills)
QUEUE_S = 3.0
FLOOD = 8
CHILD = "structured.check_process"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile-grammar"), http=True, lazy_grammar=False,
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B,
                       "--max-grammar-compile-seconds", str(COMPILE_S),
                       "--max-grammar-queue-seconds", str(QUEUE_S),
                       "--structured-check-processes", "2"],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"]).start(timeout=120)
    yield c
    c.stop()


def slow_schema(i: int) -> str:
    return json.dumps({"type": "string", "pattern": f"^[a-z]{{1,{20000 + i}}}$"})


def structured(prompt: list[int], schema: str, max_tokens: int = 4) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, stopping=pb.StoppingCriteria(max_tokens=max_tokens),
                              sampling=pb.SamplingParams(structured_output=pb.StructuredOutput(json_schema=schema)))


class HealthWatch(threading.Thread):
    """gRPC health checked every 0.1 s on a channel of its own: the slowest answer, and any that
    was not SERVING."""

    def __init__(self, stack: FakeCluster):
        super().__init__(daemon=True)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        self.channel = grpc.insecure_channel(stack.target)
        self.stub, self.request = health_pb2_grpc.HealthStub(self.channel), health_pb2.HealthCheckRequest()
        self.slowest, self.bad, self.stopped = 0.0, [], threading.Event()
        self.start()

    def run(self):
        while not self.stopped.wait(0.1):
            started = time.monotonic()
            try:
                status = self.stub.Check(self.request, timeout=5).status
            except grpc.RpcError as e:
                status = e.code()
            self.slowest = max(self.slowest, time.monotonic() - started)
            if status != SERVING:
                self.bad.append(status)

    def stop(self):
        self.stopped.set()
        self.join(10)
        self.channel.close()


def test_a_flood_of_slow_schemas_leaves_another_tenant_its_compile_and_its_stream(stack):
    victim = Stream(stack.stub, pb.GenerateRequest(
        prompt_token_ids=[7, 8, 9, 100], sampling=pb.SamplingParams(seed=1),
        stopping=pb.StoppingCriteria(max_tokens=800)), metadata=AUTH_B)
    assert wait_for(lambda: victim.tokens, 10)
    health = HealthWatch(stack)
    rss_before = rss_bytes(stack.gateway.pid)
    flood_started = time.monotonic()
    flood = [Stream(stack.stub, structured([1, 2, i], slow_schema(i)), metadata=AUTH_A, timeout=60)
             for i in range(FLOOD)]
    time.sleep(0.5)  # A's first specs hold both compilers: nobody else had asked
    started = time.monotonic()
    try:
        ours = stack.stub.Generate(structured([3, 4, 5], json.dumps({"type": "object"})),
                                   metadata=AUTH_B, timeout=30)
    except grpc.RpcError as e:
        pytest.fail(f"tenant B's structured request: {e.code()} {e.details()} after "
                    f"{time.monotonic() - started:.1f} s")
    b_took = time.monotonic() - started
    for s in flood:
        s.join(60)
    victim.join(60)
    health.stop()

    assert len(ours.token_ids) >= 1 and b_took < QUEUE_S, b_took
    assert victim.code == grpc.StatusCode.OK, victim.details
    assert victim.tokens == reference_output([7, 8, 9, 100], 800, seed=1)
    too_slow = [s for s in flood if s.code == grpc.StatusCode.INVALID_ARGUMENT]
    busy = [s for s in flood if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(too_slow) + len(busy) == FLOOD, [(s.code, s.details) for s in flood]
    assert all(s.details == ("sampling.structured_output.json_schema: compiling it took longer "
                             f"than {COMPILE_S:g} s (--max-grammar-compile-seconds)") for s in too_slow)
    assert all(s.details.startswith(f"sampling.structured_output: no grammar compiler was free "
                                    f"within {QUEUE_S:g} s (--max-grammar-queue-seconds)")
               for s in busy)
    print(f"\nflood of {FLOOD}: {len(too_slow)} timed out, {len(busy)} waited past the bound; "
          f"B's spec took {b_took:.1f} s; slowest health {health.slowest:.2f} s")
    assert len(too_slow) >= 2 and len(busy) >= 1
    # Nobody waited past the bound: every answer within it plus one compile.
    assert max(s.ended_at for s in flood) - flood_started < QUEUE_S + COMPILE_S + 2
    assert health.bad == [] and health.slowest < 1.0
    assert rss_bytes(stack.gateway.pid) - rss_before < 100e6
    # The same slow spec again is refused at once: its verdict is remembered.
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Generate(structured([1, 2, 0], slow_schema(int(too_slow[0].req.prompt_token_ids[2]))),
                            metadata=AUTH_B, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() - started < 0.5
    assert wait_for(stack.idle_and_free, 30)


def test_tools_are_compiled_only_when_tool_choice_runs_their_grammar(stack):
    """A tool whose parameters take seconds to compile: with tool_choice "auto" (the hermes
    parser reads calls from free text) nothing compiles; forced, its grammar is compiled and
    refused past the compile bound."""
    import http.client
    slow_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": json.loads(slow_schema(FLOOD + 1))}}}}

    def chat(tool_choice):
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "tools": [slow_tool], "tool_choice": tool_choice}
        started = time.monotonic()
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_B}"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        conn.close()
        return response.status, reply, time.monotonic() - started

    # The fake worker's vocabulary (1000 ids) is smaller than the chat template's tokens, so the
    # request that gets past the tool checks is refused there, at once: nothing was compiled
    # (a compile would have taken the whole bound and answered that it did).
    status, reply, took = chat("auto")
    assert (status, reply["error"]["param"]) == (400, None) and took < COMPILE_S / 2, reply
    assert "outside the vocabulary" in reply["error"]["message"]
    status, reply, took = chat("required")
    assert status == 400, reply
    assert reply["error"]["param"] == "tools" and "--max-grammar-compile-seconds" in reply["error"]["message"]


def test_the_compiler_children_die_with_a_sigkilled_gateway(stack):
    """The children are stopped first (SIGSTOP), so that nothing but their parent-death signal
    can end them: an idle child would also end at its stdin's end, a compiling one once its
    compile's bound passes and its answer finds no reader."""
    kids = children(stack.gateway.pid, CHILD)
    assert len(kids) == 2, kids

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True
    try:
        for pid in kids:
            os.kill(pid, signal.SIGSTOP)
        stack.kill(stack.gateway)
        assert wait_for(lambda: all(gone(pid) for pid in kids), 5), [
            (pid, os.path.exists(f"/proc/{pid}")) for pid in kids]
    finally:
        for pid in kids:  # a regression leaves none behind
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
