"""The queues' seam (scheduler/queues.py): every whole transition of a group (admit, swap out,
recompute, end) is one verb that moves its sequences' statuses, its handle's status and the
counts together, and the scheduler's verbs around it free or keep blocks as the block invariant
says: a running sequence holds its blocks, a swapped one its CPU blocks only, a waiting or
finished one none."""
from __future__ import annotations

from proto import internal_pb2 as pb, pagoda_pb2
from scheduler.beam_search import BeamSearch
from scheduler.request import FinishReason, Request, Status
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from scheduler.single import Single
from scheduler.step import Step

BLOCK = 4


def request(rid: str, prompt: list[int], arrival: int = 0) -> Request:
    req = Request(seq_id=f"{rid}#0", request_id=rid, index=0, gateway=b"gw",
                  prompt_token_ids=prompt, sampling=pb.SamplingConfig(), max_tokens=8,
                  arrival=arrival)
    req.group = Single(req)
    return req


def scheduler(num_blocks: int = 16, cpu_blocks: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=BLOCK, num_cpu_blocks=cpu_blocks), num_blocks)


def holds(sched: Scheduler, seq: Request) -> None:
    """The block rule for one sequence, by its status."""
    if seq.status is Status.RUNNING:
        assert len(seq.block_ids) == sched.kv.blocks_for(seq.num_computed_tokens)
        assert not seq.cpu_block_ids
    elif seq.status is Status.SWAPPED:
        assert not seq.block_ids and seq.cpu_block_ids
    else:
        assert not seq.block_ids and not seq.cpu_block_ids


def counts(sched: Scheduler) -> None:
    q = sched.queues
    assert q.num_waiting == sum(r.status is Status.WAITING for r in q.requests.values())
    assert all(g.handle.status is Status.SWAPPED for g in q.swapped)
    sched.kv.check_invariant(q.requests.values())


def admitted(sched: Scheduler, *reqs: Request) -> Step:
    for req in reqs:
        sched.add(req.group)
    sched.schedule()
    for req in reqs:
        assert req.status is Status.RUNNING
        holds(sched, req)
    counts(sched)
    return sched.in_flight[-1]


def test_admit_runs_the_group_and_gives_it_the_blocks_of_its_chunk():
    sched = scheduler()
    req = request("r", list(range(1, 10)))
    sched.add(req.group)
    assert req.status is Status.WAITING and sched.num_waiting == 1 and not req.block_ids
    sched.schedule()
    assert req.status is Status.RUNNING
    holds(sched, req)
    counts(sched)
    assert sched.num_waiting == 0 and sched.queues.running == [req.group]
    assert req.num_computed_tokens == 9 and len(req.block_ids) == 3


def test_recompute_frees_every_block_and_puts_the_group_back_in_line():
    sched = scheduler()
    req = request("r", list(range(1, 10)))
    admitted(sched, req)
    sched.recompute(req.group, [req])
    assert req.status is Status.WAITING and req.num_computed_tokens == 0
    holds(sched, req)
    counts(sched)
    assert sched.kv.num_free == 16
    assert sched.queues.next_waiting() is req.group


def test_swap_out_keeps_cpu_blocks_only_and_swap_in_brings_them_back():
    sched = scheduler(cpu_blocks=8)
    req = request("r", list(range(1, 10)))
    admitted(sched, req)
    step = Step(99, 64)
    sched.swap_out(req.group, req, step)
    assert req.status is Status.SWAPPED and sched.queues.swapped == [req.group]
    assert len(step.swap_out) == 3 and sched.kv.num_free == 16
    holds(sched, req)
    counts(sched)
    assert sched.swap_in(req.group, req, 1, step)
    assert req.status is Status.RUNNING and not sched.queues.swapped
    assert len(req.block_ids) == 3 and len(step.swap_in) == 3
    counts(sched)


def test_end_frees_every_block_and_forgets_the_group():
    sched = scheduler()
    req = request("r", list(range(1, 10)))
    admitted(sched, req)
    sched.finish(req, FinishReason.ABORT)
    assert req.status is Status.FINISHED and req.finish_reason is FinishReason.ABORT
    assert not sched.requests and not sched.groups and sched.kv.num_free == 16
    counts(sched)


def test_a_beam_search_handle_moves_with_its_group_though_it_is_no_sequence():
    sched = scheduler()
    handle = request("b", [1, 2, 3, 4, 5])
    group = BeamSearch.of(handle, pagoda_pb2.BeamSearchParams(beam_width=2))
    sched.add(group)
    assert handle.status is Status.WAITING and handle.seq_id not in sched.requests
    sched.schedule()
    assert handle.status is Status.RUNNING
    beam0 = group.beams[0]
    holds(sched, beam0)
    sched.recompute(group, group.beams)
    assert handle.status is Status.WAITING and beam0.status is Status.WAITING
    holds(sched, beam0)
    counts(sched)
    group.end(sched, FinishReason.ABORT)
    assert handle.status is Status.FINISHED and not sched.groups and sched.kv.num_free == 16


def test_a_suspect_waits_apart_from_the_line():
    sched = scheduler()
    a, b = request("a", [1, 2, 3]), request("b", [4, 5, 6], arrival=1)
    admitted(sched, a, b)
    a.group.requeue(sched, suspect=True)
    assert a.status is Status.WAITING and sched.queues.suspects == [a.group]
    assert sched.queues.next_waiting() is None  # the heap holds only what may run with others
    holds(sched, a)
    counts(sched)
