"""Where the worker's forward time goes, by kind of step: the real Router and ModelRunner in one
process (no sockets), the default offline workload, every step timed and bucketed by its number of
sequences (a step with more tokens than sequences holds a prefill chunk).

    .venv/bin/python -m bench.step_trace [--requests 16] [--threads 2] [--dtype float32] [-- worker flags]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from proto import internal_pb2 as pb
from proto.columns import unpack
from scheduler.router import Router, RouterConfig
from worker.runner import ModelRunner
from worker.worker_flags import add_worker_args
from bench.workloads import offline_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("worker_flags", nargs="*", help="after --, e.g. -- --quantization q4_1")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    budget = str(opts.max_num_batched_tokens)
    runner = ModelRunner(add_worker_args(argparse.ArgumentParser()).parse_args(
        ["--dtype", opts.dtype, "--max-num-batched-tokens", budget, *opts.worker_flags]))
    router = Router(RouterConfig(max_num_seqs=256, max_num_batched_tokens=opts.max_num_batched_tokens,
                                 max_waiting_requests=opts.requests + 1))
    router.register(b"w", runner.hello())
    for i, req in enumerate(offline_workload(opts.requests, 0)):
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=req.prompt_ids,
                                        max_tokens=req.max_tokens, ignore_eos=True,
                                        sampling=pb.SamplingConfig()))
    buckets = collections.defaultdict(lambda: [0.0, 0])
    start, tokens = time.perf_counter(), 0
    while router.workers[b"w"].scheduler.has_work:
        for wid, plan in router.plans():
            counts = list(unpack(plan.running_num_tokens)) + [s.num_new_tokens for s in plan.new_seqs]
            t = time.perf_counter()
            result = runner.execute(plan)
            elapsed = time.perf_counter() - t
            assert not result.error, result.error
            seqs = len(counts)
            kind = "with a prefill" if sum(counts) > seqs else f"decode, {seqs // 16 * 16}-{seqs // 16 * 16 + 15} seqs"
            buckets[kind][0] += elapsed
            buckets[kind][1] += 1
            router.on_result(wid, result)
        for msg in router.take_outbox().values():
            tokens += len(unpack(msg.token_ids))
    wall = time.perf_counter() - start
    print(f"{opts.requests} requests: {tokens} tokens in {wall:.1f} s, {tokens / wall:.1f} tok/s")
    forward = sum(t for t, _ in buckets.values())
    for kind, (t, n) in sorted(buckets.items()):
        print(f"{kind:24s} {n:4d} steps {t:7.1f} s ({100 * t / forward:4.1f}%)  {1e3 * t / n:7.1f} ms/step")


if __name__ == "__main__":
    main()
