"""KV memory efficiency of the scheduler on a mixed workload (prompts 16-384 tokens, outputs
8-192), against static preallocation. Pure scheduling: the worker is tests/fake_worker.py, whose
"cache" holds token ids, so the figures are the block manager's, independent of the model.

    .venv/bin/python -m bench.bench_kv [--blocks 1024] [--block-size 16] [--requests 400]
"""
from __future__ import annotations

import argparse
import random
import statistics

from proto import internal_pb2 as pb
from scheduler.request import Status
from scheduler.router import Router, RouterConfig
from tests.fake_worker import FakeWorker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    worker = FakeWorker(opts.blocks, block_size=opts.block_size)
    router = Router(RouterConfig(max_num_seqs=1024, max_num_batched_tokens=4096,
                                 max_waiting_requests=10 ** 6, enable_prefix_caching=False))
    router.register(b"w", worker.hello(max_model_len=opts.max_model_len))
    reqs = []
    for i in range(opts.requests):
        prompt = [rng.randrange(1, 999) for _ in range(rng.randint(16, 384))]
        out = rng.randint(8, 192)
        reqs.append((len(prompt), out))
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=out,
                                        sampling=pb.SamplingConfig()))
    sched = router.workers[b"w"].scheduler
    bs, utils, running, peak_used = opts.block_size, [], [], 0
    steps = 0
    while sched.has_work:
        for wid, plan in router.plans():
            router.on_result(wid, worker.execute(plan))
        router.take_outbox()
        steps += 1
        live = [r for r in sched.requests.values() if r.status is Status.RUNNING]
        used = sched.kv.num_used
        if used:
            held = sum(r.num_computed_tokens for r in live)
            utils.append((used, held / (used * bs)))
        running.append(len(live))
        peak_used = max(peak_used, used)
    at_peak = [u for used, u in utils if used >= 0.95 * peak_used]
    total_tokens = opts.blocks * bs
    static_max = total_tokens // opts.max_model_len
    static_exact = total_tokens / statistics.mean(p + o for p, o in reqs)
    busy = [r for r in running if r > 0]
    print(f"pool: {opts.blocks} blocks x {bs} = {total_tokens} token slots; {opts.requests} requests; "
          f"{steps} steps; preemptions {sched.stats.num_preemptions}")
    print(f"KV token utilization at peak (steps with >= 95% of peak blocks in use): "
          f"mean {statistics.mean(at_peak) * 100:.1f}%, min {min(at_peak) * 100:.1f}%")
    print(f"concurrent sequences: mean {statistics.mean(busy):.1f}, peak {max(running)}")
    print(f"static preallocation of max_model_len={opts.max_model_len}: {static_max} sequences -> "
          f"paged/static = {statistics.mean(busy) / max(1, static_max):.1f}x (mean)")
    print(f"static preallocation of prompt+max_tokens (mean {statistics.mean(p + o for p, o in reqs):.0f}): "
          f"{static_exact:.1f} sequences -> paged/static = {statistics.mean(busy) / static_exact:.2f}x (mean)")


if __name__ == "__main__":
    main()
