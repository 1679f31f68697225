"""Scheduler time per iteration at N running sequences: schedule, plan encoding, a ZeroMQ round
trip to a null worker in another process, decoding the result and updating state.

    .venv/bin/python bench/bench_scheduler.py [--seqs 256] [--steps 2000] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import multiprocessing as mp
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proto import internal_pb2 as pb  # noqa: E402
from proto.columns import pack, unpack  # noqa: E402
from proto.polling import poll  # noqa: E402
from scheduler.router import Router, RouterConfig  # noqa: E402


def null_worker(address: str, busy_poll_us: float) -> None:
    """Answers every plan at once: one token for each sequence that reaches its end. State lives
    in arrays indexed by slot, so that its own time stays small next to the scheduler's. It waits
    for plans as worker/main.py does."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(address)
    num_tokens = np.zeros(1 << 16, dtype=np.int64)
    num_computed = np.zeros(1 << 16, dtype=np.int64)
    sock.send(pb.WorkerMessage(hello=pb.WorkerHello(
        worker_id="null", model="null", num_blocks=65536, block_size=16, max_model_len=8192,
        vocab_size=50000, eos_token_ids=[0])).SerializeToString())
    busy_us = 0.0
    while True:
        if not poll(sock, 1000, busy_us):
            continue
        busy_us = busy_poll_us
        msg = pb.SchedulerToWorker.FromString(sock.recv())
        if msg.WhichOneof("kind") == "shutdown":
            return
        plan = msg.plan
        for s in plan.new_seqs:
            num_tokens[s.slot] = len(s.token_ids)
            num_computed[s.slot] = s.num_computed_tokens
        slots = np.concatenate([[s.slot for s in plan.new_seqs], unpack(plan.running_slots)]).astype(np.int64)
        counts = np.concatenate([[s.num_new_tokens for s in plan.new_seqs],
                                 unpack(plan.running_num_tokens)]).astype(np.int64)
        num_computed[slots] += counts
        sampled = slots[num_computed[slots] == num_tokens[slots]]
        num_tokens[sampled] += 1
        result = pb.StepResult(step_id=plan.step_id, slots=pack(sampled),
                               token_ids=pack(np.full(len(sampled), 7)))
        sock.send(pb.WorkerMessage(result=result).SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--busy-poll-us", type=float, default=500.0,
                    help="as the scheduler's and the worker's flag (their default)")
    opts = ap.parse_args()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=null_worker, args=(f"tcp://127.0.0.1:{port}", opts.busy_poll_us))
    proc.start()
    ident, data = sock.recv_multipart()
    router = Router(RouterConfig(max_num_seqs=opts.seqs, max_num_batched_tokens=8192))
    router.register(ident, pb.WorkerMessage.FromString(data).hello)
    for i in range(opts.seqs):
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", max_tokens=4096, ignore_eos=True,
                                        prompt_token_ids=[(i * 31 + j) % 50000 + 1 for j in range(opts.prompt_len)],
                                        sampling=pb.SamplingConfig()))

    phases = {"schedule": [], "encode + round trip + decode": [], "update + stream": []}

    def iteration() -> int:
        t0 = time.perf_counter()
        plans = router.plans()
        t1 = time.perf_counter()
        for wid, plan in plans:
            sock.send_multipart([wid, pb.SchedulerToWorker(plan=plan).SerializeToString()])
            poll(sock, 1000, opts.busy_poll_us)  # as scheduler/server.py waits for a result
            _, reply = sock.recv_multipart()
            result = pb.WorkerMessage.FromString(reply).result
            t2 = time.perf_counter()
            router.on_result(wid, result)
        for msg in router.take_outbox().values():
            msg.SerializeToString()
        t3 = time.perf_counter()
        if plans:
            for key, a, b in zip(phases, (t0, t1, t2), (t1, t2, t3)):
                phases[key].append(b - a)
        return len(plans)

    while any(r.num_computed_tokens < opts.prompt_len for r in router.workers[ident].scheduler.requests.values()):
        iteration()  # prefill until every sequence decodes
    for v in phases.values():
        v.clear()
    if opts.no_gc:
        # The loop allocates little that lives: a frozen, disabled collector takes its pauses
        # out of the tail (the server does the same, see scheduler/main.py).
        gc.collect()
        gc.freeze()
        gc.disable()
    running = len(router.workers[ident].scheduler.running)
    profiler = cProfile.Profile() if opts.profile else None
    times = []
    if profiler:
        profiler.enable()
    for _ in range(opts.steps):
        t0 = time.perf_counter()
        iteration()
        times.append(time.perf_counter() - t0)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    sock.send_multipart([ident, pb.SchedulerToWorker(shutdown=True).SerializeToString()])
    proc.join(5)
    times.sort()
    print(f"running sequences: {running}, steps: {opts.steps}")
    print(f"per iteration: median {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms"
          f"{' (gc frozen)' if opts.no_gc else ''}")
    for key, v in phases.items():
        print(f"  {key}: median {statistics.median(v) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
