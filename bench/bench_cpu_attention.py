#!/usr/bin/env python3
"""The CPU attention kernels at SmolLM2's heads (9 query, 3 kv, 64 dims, blocks of 16), fp32 and bf16.

    .venv/bin/python -m bench.bench_cpu_attention [--shapes 8x256,1x2048,4x512+256] [--repeats 15]
    .venv/bin/python -m bench.bench_cpu_attention --decode [--rows 64]
    .venv/bin/python -m bench.bench_cpu_attention --paths [RUNS]

Prefill (default): kernels/csrc/cpu_prefill_attention.c against the path it replaces (kernels/
cpu_attention.py's gather of each sequence's context and torch's flash SDPA), one layer over
shuffled blocks, alternating, medians of --repeats. A shape NxT[+C] is N sequences of T new
tokens after C cached ones; the table gives each path's milliseconds and GFLOP/s (causal: 2 * 2 *
Hq * D * T * (C + (T + 1) / 2) per sequence).

--decode: kernels/csrc/cpu_decode_attention.c for --rows decode rows with contexts of 200-600, over 30
layers' caches (as a step reads them: 600 MB in bf16 at 64 rows, far past any cache, in huge
pages as the worker's cache lies), block tables scattered (shuffled blocks) and contiguous;
milliseconds a step (30 layers) and the GB/s of keys and values read, with the kernel's prefetch
on and off (worker/startup/measurements.py chooses one per machine). Run it in two trees to
compare kernels.

--paths: kernels/cpu_attention.py's paths for sequences of m new tokens (decode rows, the short
path, SDPA, and the C prefill kernel where it runs), batches of 1 and 16, contexts of 128-2048:
the crossovers behind its path bounds; each path's once-a-step plan timed apart.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit

import torch

from pagoda.kernels import cpu_attention, cpu_prefill_attention

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


def paths(runs: int) -> None:
    """Median ms of one layer's attention per path, runs alternating; the once-a-step plan apart.
    The C prefill kernel (kernels/csrc/cpu_prefill_attention.c) is a fourth column where it runs."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {HQ}/{HKV} heads, D={D}, "
          f"block {BS}, C prefill kernel: {cpu_prefill_attention.isa()}\n\n| dtype | B | context | m | "
          "decode rows ms | short ms | SDPA ms | C prefill ms | plan ms: rows / short / SDPA / C |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for dtype, batch, ctx in ((t, b, c) for t in (torch.float32, torch.bfloat16) for b in (1, 16)
                              for c in (128, 512, 2048)):
        nb = batch * ctx // BS
        k, v = (torch.randn(nb, BS, HKV, D).to(dtype) for _ in range(2))
        tables, lens = torch.randperm(nb).view(batch, -1).int(), torch.full((batch,), ctx).int()
        kernel = cpu_prefill_attention.runs_on(k, HQ)
        for m in (1, 2, 4, 8, 16, 32):
            qsl, q = (torch.arange(batch + 1) * m).int(), torch.randn(batch * m, HQ, D).to(dtype)
            bounds = [(m, m, False), (0, m, False), (0, 0, False)] + ([(0, 0, True)] if kernel else [])
            plans = [lambda r=r, s=s, c=c: cpu_attention.plan_attention(
                         tables, lens, qsl, k, HQ, max_decode_rows=r, max_short_query=s, prefill_kernel=c)
                     for r, s, c in bounds]   # each path takes every sequence
            built = [p() for p in plans]
            calls = [lambda p=p: cpu_attention.paged_attention(q, k, v, p, D ** -0.5) for p in built] + plans
            rounds = [[timeit.timeit(f, number=1) * 1e3 for f in calls] for _ in range(runs + 1)]
            t = [sorted(col)[runs // 2] for col in zip(*rounds[1:])]   # round 0 warms up
            n = len(built)
            c_ms = f"{t[3]:.2f}" if kernel else "-"
            print(f"| {str(dtype)[6:]} | {batch} | {ctx} | {m} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {c_ms} | "
                  + " / ".join(f"{x:.2f}" for x in t[n:]) + " |", flush=True)


def _in_huge_pages(x: torch.Tensor) -> torch.Tensor:
    """x copied into memory laid out as the worker's KV cache is (worker/model/kv_cache.py zeroed_host:
    huge pages where the kernel gives them), so that TLB misses are the worker's, not torch's."""
    from worker.model.kv_cache import zeroed_host
    return zeroed_host(tuple(x.shape), x.dtype).copy_(x)


def decode(rows: int, repeats: int) -> None:
    from pagoda.kernels import cpu_decode_attention
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 600, (rows,), generator=g, dtype=torch.int32)
    blocks = [-(-int(n) // BS) for n in lens]
    total = sum(blocks)
    print(f"threads {torch.get_num_threads()}, kernel {cpu_decode_attention.isa()}, {rows} rows\n")
    print("| tables | dtype | prefetch | ms a step (30 layers) | GB/s of K and V |\n|---|---|---|---|---|")
    for layout in ("scattered", "contiguous"):
        order = torch.randperm(total, generator=g) if layout == "scattered" else torch.arange(total)
        tables = torch.zeros(rows, max(blocks), dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = order[used:used + n].int()
            used += n
        for dtype in (torch.float32, torch.bfloat16):
            caches = [(_in_huge_pages(torch.randn(total, BS, HKV, D, generator=g).to(dtype)),
                       _in_huge_pages(torch.randn(total, BS, HKV, D, generator=g).to(dtype))) for _ in range(30)]
            q = torch.randn(rows, HQ, D, generator=g)
            out, which = torch.empty_like(q), torch.arange(rows)

            def step(ahead):
                for k, v in caches:
                    cpu_decode_attention.decode(q, k, v, which, lens, tables, D ** -0.5, out, ahead=ahead)
            read = 30 * 2 * int(lens.sum()) * HKV * D * caches[0][0].element_size()
            for ahead in (True, False):
                ms = _median_ms(lambda: step(ahead), repeats)
                print(f"| {layout} | {str(dtype)[6:]} | {'on' if ahead else 'off'} | {ms:.1f} | "
                      f"{read / ms / 1e6:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x256,1x2048,4x512+256,16x128")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--paths", nargs="?", const=9, type=int, metavar="RUNS")
    args = ap.parse_args()
    if args.paths:
        paths(args.paths)
        return 0
    if args.decode:
        decode(args.rows, args.repeats)
        return 0
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
