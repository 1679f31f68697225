"""A sequence with a grammar waits, as vLLM's WAITING_FOR_FSM, until its worker has compiled the
grammar, and nothing else waits with it: the real scheduler and gateway, with a fake worker
process whose compiles take --grammar-compile-delay seconds (the real worker's are off its loop
too: tests/unit/worker/test_worker_grammar.py). The fake's tokens ignore the grammar; the point here is
who waits for what."""
from __future__ import annotations

import time

import grpc
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for
from tests.fake_cluster import FakeCluster, children
from tests.fake_worker import reference_output
from tests.fake_worker_main import GRAMMAR_FAILS
from tests.streams import Stream

pytestmark = pytest.mark.integration

COMPILE_S = 1.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(tmp_path_factory.mktemp("grammar-waits"), lazy_grammar=False, worker_flags=[
        "--step-delay", "0.01", "--grammar-compile-delay", str(COMPILE_S)]).start()
    # As soon as it is ready, before any request: the gateway's grammar check's compiler is up
    # and has loaded its vocabulary (readiness waits for it)
    c.checker_at_start = children(c.gateway.pid, "structured.check_process")
    c.log_at_start = (c.log_dir / "gateway.log").read_text(errors="replace")
    yield c
    c.stop()


def test_the_gateway_is_ready_once_its_grammar_compilers_are_warm(stack):
    """Loading the vocabulary takes a child seconds (2.7 s for SmolLM2 on a Zen 2 EPYC), which
    the first structured request waited for, and which, in the background after readiness, took
    the CPU from the first request of any kind; --structured-outputs-lazy keeps the old way."""
    assert len(stack.checker_at_start) == 2, stack.log_tail()  # --structured-check-processes
    assert "the structured-output check's 2 compilers are ready" in stack.log_at_start, stack.log_tail()
    answer = stack.stub.Generate(constrained([4, 5], "[a-z]{1,8}"), timeout=30)
    assert list(answer.token_ids) == reference_output([4, 5], 8, seed=3, ignore_eos=True)
    assert sorted(children(stack.gateway.pid, "structured.check_process")) == sorted(stack.checker_at_start)


def constrained(prompt: list[int], regex: str, max_tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        seed=3, structured_output=pb.StructuredOutput(regex=regex)),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def test_a_grammar_request_waits_for_its_compile_while_other_streams_go_on(stack):
    plain = Stream(stack.stub, pb.GenerateRequest(
        prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(seed=1),
        stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)))
    assert wait_for(lambda: plain.tokens, 10)
    sent = time.monotonic()
    # Two requests of one grammar: one compile for both.
    waiting = [Stream(stack.stub, constrained([9, 9, i], "[a-z]{1,8}")) for i in range(2)]
    for w in waiting:
        w.join(30)
        assert w.code == grpc.StatusCode.OK, w.details
    for i, w in enumerate(waiting):
        assert w.tokens == reference_output([9, 9, i], 8, seed=3, ignore_eos=True)
        assert w.token_times[0] - sent >= COMPILE_S * 0.9  # not admitted before the compile
    first = min(w.token_times[0] for w in waiting)
    during = sum(sent < t < first for t in plain.token_times)
    print(f"\nthe plain stream got {during} tokens while the grammar compiled")
    assert during >= 50  # 10 ms a step: about 150
    plain.join(30)
    assert plain.tokens == reference_output([5, 6, 7], 400, seed=1, ignore_eos=True)
    assert wait_for(stack.idle_and_free, 10), stack.scheduler_metrics()


def test_a_grammar_the_worker_cannot_compile_ends_with_invalid_argument(stack):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Generate(constrained([4, 4], GRAMMAR_FAILS), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "structured_output does not compile: the fake worker refuses it"
    assert time.monotonic() - started >= COMPILE_S * 0.9
    assert wait_for(stack.idle_and_free, 10), stack.scheduler_metrics()
