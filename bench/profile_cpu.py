#!/usr/bin/env python3
"""Times and profiles the CPU worker's step on the real SmolLM2-135M, through ModelRunner.execute.

    .venv/bin/python -m bench.profile_cpu [--tree DIR] [--profile] [-- worker flags]
    .venv/bin/python -m bench.profile_cpu --attention-ab 4 --steps 15 [-- worker flags]
    .venv/bin/python -m bench.profile_cpu --fused-ab 2 --steps 8 -- --quantization q4_1

Scenarios: steady decode of 1, 32 and 64 sequences with contexts drawn from 200-600 tokens, and
32 decodes plus a 256-token prefill in the same step. --profile-seqs picks the decode profiled
(1: a single stream's step, where everything that is not a weight read shows). The KV cache is filled with noise instead
of being prefilled (attention costs the same whatever the keys hold), so a run takes seconds.
--tree imports pagoda from another checkout, e.g. an exported older commit
(`git archive HEAD | tar -x -C /tmp/before`), so that before and after run on the same machine
minutes apart; worker flags after `--` must be ones that tree knows.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

CONTEXTS = (200, 600)
PREFILL = 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--steps", type=int, default=10, help="timed steps per scenario")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of decode steps")
    p.add_argument("--profile-seqs", type=int, default=64, help="sequences in the profiled decode")
    p.add_argument("--threads", type=int, default=0, help="torch threads, 0 = torch's default")
    p.add_argument("--attention-ab", type=int, default=0, metavar="ROUNDS",
                   help="only: decode 1 with kernels/cpu_decode_attention.c and with the torch path, "
                        "alternating ROUNDS times in this process (medians of every step of each)")
    p.add_argument("--fused-ab", type=int, default=0, metavar="ROUNDS",
                   help="only: decode 1, 8, 32 and 64 with worker/model/fused_decode.py's C step and layer by "
                        "layer, alternating ROUNDS times (use with -- --quantization q4_1)")
    p.add_argument("worker_flags", nargs="*")
    args = p.parse_args()
    # The tree to measure comes first on the path, before any installed copy.
    sys.path[0] = args.tree

    import torch
    from tests.worker_tiny_models import runner_args
    from worker.runner import ModelRunner
    if args.threads:
        torch.set_num_threads(args.threads)

    blocks_per_seq = -(-(CONTEXTS[1] + 2 * args.steps + 8) // 16)
    num_blocks = 64 * blocks_per_seq + PREFILL // 16
    start = time.perf_counter()
    runner = ModelRunner(runner_args("", *args.worker_flags, num_blocks=num_blocks))
    print(f"tree {args.tree} flags {args.worker_flags} start-up {time.perf_counter() - start:.1f} s, "
          f"{torch.get_num_threads()} threads, {runner.dtype}")
    runner.cache.device_cache.normal_(generator=torch.Generator().manual_seed(0))
    if args.attention_ab:
        attention_ab(runner, args.attention_ab, args.steps, blocks_per_seq)
        return
    if args.fused_ab:
        fused_ab(runner, args.fused_ab, args.steps, blocks_per_seq)
        return
    for name, seqs, prefill in (("decode 1", 1, False), ("decode 32", 32, False), ("decode 64", 64, False),
                                ("32 decodes + 256-token prefill", 32, True)):
        times = run_scenario(runner, seqs, prefill, args.steps, blocks_per_seq)
        print(f"{name:32s} median {statistics.median(times) * 1e3:7.1f} ms  "
              f"min {min(times) * 1e3:7.1f} ms  over {len(times)} steps")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_scenario(runner, args.profile_seqs, False, 10 if args.profile_seqs < 8 else 3,
                         blocks_per_seq, warmup=0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                        max_name_column_width=48))


def attention_ab(runner, rounds: int, steps: int, blocks_per_seq: int) -> None:
    from pagoda.kernels import cpu_decode_attention
    runs_on = cpu_decode_attention.runs_on
    times: dict[str, list[float]] = {"C kernel": [], "torch ops": []}
    try:
        for _ in range(rounds):
            for name in times:
                cpu_decode_attention.runs_on = runs_on if name == "C kernel" else (lambda k_cache: False)
                times[name] += run_scenario(runner, 1, False, steps, blocks_per_seq)
    finally:
        cpu_decode_attention.runs_on = runs_on
    for name, t in times.items():
        print(f"decode 1, attention and KV writes by {name:9s}: median {statistics.median(t) * 1e3:6.1f} ms "
              f"over {len(t)} steps")


def fused_ab(runner, rounds: int, steps: int, blocks_per_seq: int) -> None:
    from worker.model import fused_decode
    if runner.model.model.fused_decode is None:
        raise SystemExit("this model takes no fused decode step (see worker/model/fused_decode.py)")
    times = {(seqs, on): [] for seqs in (1, 8, 32, 64) for on in (True, False)}
    try:
        for _ in range(rounds):
            for seqs, on in times:
                fused_decode.enabled = on
                times[seqs, on] += run_scenario(runner, seqs, False, steps, blocks_per_seq)
    finally:
        fused_decode.enabled = True
    for (seqs, on), t in times.items():
        print(f"decode {seqs:2d}, {'one C step    ' if on else 'layer by layer'}: median "
              f"{statistics.median(t) * 1e3:6.1f} ms over {len(t)} steps")


def run_scenario(runner, num_seqs: int, prefill: bool, steps: int, blocks_per_seq: int,
                 warmup: int = 2) -> list[float]:
    """Registers num_seqs sequences whose context is already cached, then times decode steps."""
    from proto import internal_pb2
    from proto.columns import pack

    rng = random.Random(num_seqs)
    vocab = runner.config.vocab_size
    new = []
    for slot in range(num_seqs):
        ctx = rng.randint(*CONTEXTS)
        blocks = list(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))
        new.append(internal_pb2.NewSeq(seq_id=f"s{slot}", slot=slot, block_ids=blocks,
                                       token_ids=[rng.randrange(vocab) for _ in range(ctx + 1)],
                                       num_computed_tokens=ctx, num_new_tokens=1))
    assert not runner.execute(internal_pb2.StepPlan(new_seqs=new)).error
    prefill_blocks = list(range(64 * blocks_per_seq, 64 * blocks_per_seq + PREFILL // 16))
    times = []
    for step in range(warmup + steps):
        plan = internal_pb2.StepPlan(running_slots=pack(range(num_seqs)),
                                     running_num_tokens=pack([1] * num_seqs))
        if prefill:
            slot = 1000 + step
            plan.dropped_slots.append(slot - 1)
            plan.new_seqs.add(seq_id=f"p{step}", slot=slot, block_ids=prefill_blocks,
                              token_ids=[rng.randrange(vocab) for _ in range(PREFILL)],
                              num_new_tokens=PREFILL)
        start = time.perf_counter()
        result = runner.execute(plan)
        elapsed = time.perf_counter() - start
        assert not result.error, result.error
        if step >= warmup:
            times.append(elapsed)
    runner.execute(internal_pb2.StepPlan(dropped_slots=[*range(num_seqs), 1000 + warmup + steps - 1]))
    return times


if __name__ == "__main__":
    main()
