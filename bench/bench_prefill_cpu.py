#!/usr/bin/env python3
"""Prefill attention on the CPU: kernels/cpu_prefill_attention.c against the path it replaces
(kernels/cpu_attention.py's gather of each sequence's context and torch's flash SDPA), one layer
of SmolLM2's heads (9 query, 3 kv, 64 dims, blocks of 16) over shuffled blocks, in fp32 and bf16,
alternating, medians of --repeats.

    .venv/bin/python bench/bench_prefill_cpu.py [--shapes 8x256,1x2048,4x512+256] [--repeats 15]

A shape NxT[+C] is N sequences of T new tokens after C cached ones. Prints a markdown table with
each path's milliseconds and GFLOP/s (causal: 2 * 2 * Hq * D * T * (C + (T + 1) / 2) per sequence).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import cpu_attention, cpu_prefill_attention  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def _step(n: int, t: int, c: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    per_seq = -(-(t + c) // BS)
    num_blocks = n * per_seq + 1
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:n * per_seq].view(n, per_seq).to(torch.int32)
    q = torch.randn(n * t, HQ, D, generator=g).to(dtype)
    lens = torch.full((n,), t + c, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32) * t
    return q, k_cache, v_cache, tables, lens, qsl


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x256,1x2048,4x512+256,16x128")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    print(f"threads {torch.get_num_threads()}, kernel {cpu_prefill_attention.isa()}\n")
    print("| shape | dtype | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | speed-up |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        head, _, cached = shape.partition("+")
        n, t = (int(x) for x in head.split("x"))
        c = int(cached or 0)
        flops = n * 4 * HQ * D * t * (c + (t + 1) / 2)
        for dtype in (torch.float32, torch.bfloat16):
            q, k_cache, v_cache, tables, lens, qsl = _step(n, t, c, dtype)
            plan = cpu_attention.plan_attention(tables, lens, qsl, k_cache, HQ, prefill_kernel=False)
            kplan = cpu_attention.plan_attention(tables, lens, qsl, k_cache, HQ, prefill_kernel=True)
            out = torch.empty_like(q)
            sdpa = lambda: cpu_attention.paged_attention(q, k_cache, v_cache, plan, D ** -0.5, out)  # noqa: E731
            kernel = lambda: cpu_attention.paged_attention(q, k_cache, v_cache, kplan, D ** -0.5, out)  # noqa: E731
            a, b = [], []
            for _ in range(3):  # alternating: the VM's speed drifts
                a.append(_median_ms(sdpa, args.repeats))
                b.append(_median_ms(kernel, args.repeats))
            ms_a, ms_b = statistics.median(a), statistics.median(b)
            print(f"| {shape} | {str(dtype)[6:]} | {ms_a:.2f} | {ms_b:.2f} | {flops / ms_a / 1e6:.0f} | "
                  f"{flops / ms_b / 1e6:.0f} | {ms_a / ms_b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
