"""Sequences with a grammar wait until their worker has compiled it (scheduler/grammar_waits.py):
the router, an in-process fake worker, and the worker's answers given by hand, as the worker's
loop would send them between steps."""
from __future__ import annotations

from proto import internal_pb2 as pb, pagoda_pb2
from structured.spec import Spec
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import GW, check, collect, make_router, run, step, with_workers

REGEX = pagoda_pb2.StructuredOutput(regex="[a-z]+")
OTHER = pagoda_pb2.StructuredOutput(regex="[0-9]+")


def add(router, rid, prompt, max_tokens, spec=None, n=1):
    sampling = pb.SamplingConfig(has_seed=True, seed=7)
    if spec is not None:
        sampling.structured_output.CopyFrom(spec)
    router.add(GW, pb.AddRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                                 n=n, sampling=sampling))


def key(spec) -> str:
    return Spec.from_proto(spec).key()


def asked(router) -> list[tuple[bytes, list[str]]]:
    return [(wid, [g.key for g in m.grammars]) for wid, m in router.grammar_requests()]


def test_a_grammar_request_waits_for_its_compile_and_others_run_meanwhile():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "g", [1, 2, 3], 5, REGEX, n=2)
    add(router, "g2", [4, 5, 6], 5, REGEX)  # the same grammar: asked for once
    add(router, "h", [7, 8, 9], 5, OTHER)
    add(router, "plain", [9, 9, 9], 5)
    assert asked(router) == [(b"w0", [key(REGEX)]), (b"w0", [key(OTHER)])]
    assert asked(router) == []  # once
    out = {}
    run(router, workers, out)  # everything that may run, runs
    assert set(out) == {("plain", 0)}
    sched = router.workers[b"w0"].scheduler
    assert sched.num_waiting == 4 and sched.kv.num_free == sched.kv.num_blocks
    router.on_compiled(b"w0", pb.GrammarsCompiled(ready=[key(REGEX)]))
    run(router, workers, out)
    for rid, index, prompt in (("g", 0, [1, 2, 3]), ("g", 1, [1, 2, 3]), ("g2", 0, [4, 5, 6])):
        assert out[(rid, index)]["tokens"] == reference_output(prompt, 5, seed=7 + index)
    assert ("h", 0) not in out and sched.num_waiting == 1
    check(router)


def test_a_grammar_that_does_not_compile_ends_its_sequences_with_invalid_argument():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "bad", [1, 2, 3], 5, REGEX, n=3)
    router.grammar_requests()
    router.on_compiled(b"w0", pb.GrammarsCompiled(failed=[pb.GrammarFailure(
        key=key(REGEX), reason="the compiler's reason")]))
    out = {}
    run(router, workers, out)
    assert sorted(out) == [("bad", 0), ("bad", 1), ("bad", 2)]
    for entry in out.values():
        assert entry["tokens"] == [] and entry["finish"] == pb.ERROR
        assert entry["error"] == "INVALID_ARGUMENT"
        assert entry["message"] == "structured_output does not compile: the compiler's reason"
    sched = router.workers[b"w0"].scheduler
    assert not sched.requests and sched.num_waiting == 0 and not router.seqs


def test_an_abort_while_waiting_frees_it_and_a_late_answer_changes_nothing():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "g", [1, 2, 3], 5, REGEX)
    router.grammar_requests()
    router.abort("g")
    sched = router.workers[b"w0"].scheduler
    assert not sched.requests and sched.num_waiting == 0
    router.on_compiled(b"w0", pb.GrammarsCompiled(ready=[key(REGEX)], failed=[
        pb.GrammarFailure(key="not a key anyone waits for", reason="x")]))
    out = {}
    run(router, workers, out)
    assert out == {} and not sched.grammars.waiting


def test_sequences_of_a_lost_worker_wait_again_for_the_grammar_on_the_next():
    router = make_router()
    workers = with_workers(router, FakeWorker(64))
    add(router, "g", [1, 2, 3], 6, REGEX)
    assert asked(router) == [(b"w0", [key(REGEX)])]
    router.on_compiled(b"w0", pb.GrammarsCompiled(ready=[key(REGEX)]))
    out = {}
    step(router, workers, out)
    step(router, workers, out)
    assert out[("g", 0)]["tokens"]  # it ran on w0
    router.remove(b"w0", "lost")
    workers.update(with_workers_named(router, b"w1", FakeWorker(64)))
    del workers[b"w0"]
    assert asked(router) == [(b"w1", [key(REGEX)])]  # w1 has not compiled it
    before = len(out[("g", 0)]["tokens"])
    run(router, workers, out)
    assert len(out[("g", 0)]["tokens"]) == before  # it waits on w1
    router.on_compiled(b"w1", pb.GrammarsCompiled(ready=[key(REGEX)]))
    run(router, workers, out)
    assert out[("g", 0)]["tokens"] == reference_output([1, 2, 3], 6, seed=7)
    check(router)


def with_workers_named(router, wid: bytes, worker: FakeWorker) -> dict:
    router.register(wid, worker.hello())
    return {wid: worker}
