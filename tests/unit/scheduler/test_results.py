"""The results' seam (scheduler/results.py) and the stream's owner (scheduler/stream.py): every
token a sequence samples is streamed exactly once, in order, with offsets that continue each
other, its usage figures with its first tokens (or with its finish, if it ends in that result),
its finish last; a final_only sequence's tokens are held and go out with its finish, in one
update. Logprobs go to the gateway named by request and index, in a message of their own: the
worker's is never edited."""
from __future__ import annotations

from proto import internal_pb2 as pb
from proto.columns import pack
from proto.token_stream import updates
from scheduler.request import Request
from scheduler.stream import Streams
from tests.fake_worker import FakeWorker, reference_output
from tests.unit.scheduler.test_scheduler import add, make_router, with_workers


def usage(prompt: int = 3) -> Request:
    return Request(seq_id="r#0", request_id="r", index=0, gateway=b"gw",
                   prompt_token_ids=list(range(1, prompt + 1)), sampling=pb.SamplingConfig(),
                   max_tokens=8, queue_time=0.5, num_cached_tokens=2)


def sent(streams: Streams):
    msg = streams.take().get(b"gw", pb.SchedulerMessage())
    return [(u.offset, u.token_ids, u.news) for u in updates(msg)]


def test_first_tokens_carry_the_usage_figures_once_and_later_ones_none():
    streams, req = Streams(), usage()
    streams.tokens(req.stream, [7], req)
    [(o1, t1, first)] = sent(streams)  # a message per step, as the server sends them
    streams.tokens(req.stream, [8, 9], req)
    [(o2, t2, later)] = sent(streams)
    assert (o1, t1, o2, t2) == (0, [7], 1, [8, 9])
    assert first.prompt_tokens == 3 and first.cached_prompt_tokens == 2 and first.offset == 1
    assert later is None and not first.finish


def test_a_sequence_that_ends_in_its_first_result_says_everything_in_one_delta():
    streams, req = Streams(), usage()
    streams.tokens(req.stream, [7], req)
    streams.end(req.stream, req, pb.STOP)
    streams.flush()
    [(offset, tokens, news)] = sent(streams)
    assert (offset, tokens) == (0, [7])
    assert news.finish == pb.STOP and news.prompt_tokens == 3 and news.offset == 1


def test_final_only_holds_every_token_for_its_finish():
    streams, req = Streams(), usage()
    req.stream.final_only = True
    for token in (4, 5, 6):
        streams.tokens(req.stream, [token], req)
        streams.flush()
        assert not sent(streams)
    streams.end(req.stream, req, pb.LENGTH)
    [(offset, tokens, news)] = sent(streams)
    assert (offset, tokens, news.finish, news.offset) == (0, [4, 5, 6], pb.LENGTH, 3)
    assert news.first_token_s > 0


def test_an_end_is_said_once():
    streams, req = Streams(), usage()
    streams.end(req.stream, req, pb.ABORT)
    streams.end(req.stream, req, pb.ERROR, pb.Error(code="INTERNAL"))
    [(_, _, news)] = sent(streams)
    assert news.finish == pb.ABORT and not news.HasField("error")


def test_logprobs_go_out_named_by_request_and_the_workers_message_stays_as_it_came():
    streams, req = Streams(), usage()
    worker_lp = pb.SlotLogprobs(slot=5, first_position=3, k=0, token_ids=pack([7]))
    streams.logprobs(req.stream, worker_lp)
    [out] = streams.take()[b"gw"].logprobs
    assert (out.request_id, out.index, out.first_position, out.token_ids) == \
        ("r", 0, 3, worker_lp.token_ids)


def test_every_token_of_a_running_cluster_is_streamed_once_in_order():
    router = make_router(max_num_batched_tokens=16)
    workers = with_workers(router, FakeWorker(12, block_size=4))  # small: preemptions happen
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(5)}
    for rid, prompt in prompts.items():
        add(router, rid, prompt, 10, final_only=rid == "r2")
    got: dict[str, list] = {rid: [] for rid in prompts}
    for _ in range(500):
        plans = router.plans()
        for wid, plan in plans:
            router.on_result(wid, workers[wid].execute(plan))
        for msg in router.take_outbox().values():
            for u in updates(msg):
                got[u.request_id].append(u)
        if not plans:
            break
    assert router.workers[b"w0"].scheduler.stats.num_preemptions
    for rid, prompt in prompts.items():
        tokens, offset = [], 0
        for u in got[rid]:
            assert u.offset == offset  # nothing lost, nothing repeated
            tokens += u.token_ids
            offset += len(u.token_ids)
        assert tokens == reference_output(prompt, 10)
        assert got[rid][-1].finish == pb.LENGTH
        assert sum(u.news is not None and u.news.prompt_tokens > 0 for u in got[rid]) == \
            (1 if rid == "r2" else 2)  # first figures, then the finish (final_only: one)
    assert len(got["r2"]) == 1
