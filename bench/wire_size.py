"""What travels between hosts per step: bytes of each StepPlan (scheduler -> worker), each
StepResult (worker -> scheduler) and each SchedulerMessage (scheduler -> gateway) at N running
decode sequences, serialized by the real encoders (proto/columns.py, the real Router and its
plan diffs), with the fake worker of the scheduler tests standing in for the model.

    .venv/bin/python -m bench.wire_size [--seqs 256] [--prompt-len 128] [--steps 200]

Prints the admission (the plans that carry the prompts once), the steady decode per step (mean
and max: a step where sequences cross a block boundary carries their new block ids), and what
those sizes cost on the wire at 1 and 10 Gb/s. CURVE adds a fixed 16-byte MAC and 8-byte nonce
(and a few bytes of framing) per message on top of these sizes.
"""
from __future__ import annotations

import argparse
import statistics
import uuid

from proto import internal_pb2 as pb
from scheduler.router import Router, RouterConfig
from tests.fake_worker import FakeWorker

CURVE_OVERHEAD = 16 + 8 + 9  # MAC, short nonce, MESSAGE command framing (ZMTP 3 CURVE)


def measure(seqs: int, prompt_len: int, steps: int, block_size: int = 16) -> dict:
    router = Router(RouterConfig(max_num_seqs=seqs, max_num_batched_tokens=8192))
    blocks = seqs * ((prompt_len + steps + 64) // block_size + 2)
    worker = FakeWorker(blocks, block_size=block_size)
    router.register(b"w0", worker.hello(max_model_len=8192))
    gateway_id = uuid.uuid4().hex  # the gateway's request ids: <its uuid>-<n>
    for i in range(seqs):
        length = prompt_len + i % block_size  # staggered: block boundaries fall on different steps
        router.add(b"gw", pb.AddRequest(
            request_id=f"{gateway_id}-{i}", max_tokens=steps + 64, ignore_eos=True,
            prompt_token_ids=[(i * 31 + j) % 997 + 1 for j in range(length)],
            sampling=pb.SamplingConfig()))
    sched = router.workers[b"w0"].scheduler
    admission = {"plans": 0, "plan_bytes": 0}
    decode = {"plan": [], "result": [], "gateway": []}

    def step(record: bool) -> None:
        for wid, plan in router.plans():
            plan_bytes = len(pb.SchedulerToWorker(plan=plan).SerializeToString())
            result = worker.execute(plan)
            result.forward_seconds = 0.0123  # a real worker reports its forward time
            result_bytes = len(pb.WorkerMessage(result=result).SerializeToString())
            router.on_result(wid, result)
            gateway_bytes = sum(len(m.SerializeToString()) for m in router.take_outbox().values())
            if record:
                decode["plan"].append(plan_bytes)
                decode["result"].append(result_bytes)
                decode["gateway"].append(gateway_bytes)
            else:
                admission["plans"] += 1
                admission["plan_bytes"] += plan_bytes

    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        step(record=False)
    running = len(sched.running)
    for _ in range(steps):
        step(record=True)
    return {"running": running, "admission": admission,
            **{k: (statistics.mean(v), max(v)) for k, v in decode.items()}}


def wire_us(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    opts = ap.parse_args()
    r = measure(opts.seqs, opts.prompt_len, opts.steps)
    a = r["admission"]
    print(f"{r['running']} running decode sequences, prompts of {opts.prompt_len}-"
          f"{opts.prompt_len + 15} tokens, {opts.steps} decode steps measured")
    print(f"admission: {a['plans']} plans, {a['plan_bytes']} B in all (the prompts' token ids, once)")
    print("| per decode step | mean B | max B | at 1 Gb/s | at 10 Gb/s |")
    print("|---|---|---|---|---|")
    total = 0.0
    for key, label in (("plan", "plan, scheduler -> worker"), ("result", "result, worker -> scheduler"),
                       ("gateway", "tokens, scheduler -> gateway")):
        mean, peak = r[key]
        total += mean + CURVE_OVERHEAD
        print(f"| {label} | {mean:.0f} | {peak} | {wire_us(mean + CURVE_OVERHEAD, 1):.1f} us | "
              f"{wire_us(mean + CURVE_OVERHEAD, 10):.2f} us |")
    print(f"| all three, with CURVE's {CURVE_OVERHEAD} B each | {total:.0f} | | "
          f"{wire_us(total, 1):.1f} us | {wire_us(total, 10):.2f} us |")


if __name__ == "__main__":
    main()
