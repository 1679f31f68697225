"""The CPU projections of one SmolLM2-135M step (30 layers' qkv, o, gate_up and down, and the LM
head: 538 MB of fp32 weights, far beyond any cache), by number of rows, through torch's
F.linear (MKL) and through kernels/cpu_gemm.c, interleaved in one run; best of --repeats.

    .venv/bin/python bench/bench_gemm.py [--rows 1,4,8,16,32,64,128,256,512,1024,2048] [--threads 2]
    .venv/bin/python bench/bench_gemm.py --dtype bfloat16 --rows 1,2,4,8,16,32

--dtype bfloat16 runs the same set in bf16 (269 MB) through torch and kernels/cpu_gemm_bf16.c,
on each instruction-set path this CPU has.

It prints each path's time for the whole set, the weight bytes streamed per second and the
arithmetic rate, next to a 512 x 576 x 1536 MKL GEMM and a 540 MB sum (the machine's memory rate)
measured in the same run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import cpu_gemm, cpu_gemm_bf16  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, intermediate 1536, 30 layers, vocab 49152.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    if dtype == torch.float32:
        if not cpu_gemm.available():
            sys.exit("kernels/cpu_gemm.c cannot run here (no AVX2 or no C compiler)")
        paths = [("kernel", cpu_gemm.xwt)]
    else:
        if not cpu_gemm_bf16.available():
            sys.exit("kernels/cpu_gemm_bf16.c cannot run here (no AVX2 or no C compiler)")
        paths = [(cpu_gemm_bf16.ISA_NAMES[i], lambda x, w, i=i: cpu_gemm_bf16.xwt(x, w, i))
                 for i in cpu_gemm_bf16.supported_isas()]
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in SHAPES]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)

    a, b = torch.randn(512, 576), torch.randn(1536, 576)
    gemm = 2 * 512 * 576 * 1536 / best_of(10, lambda: F.linear(a, b)) / 1e9
    big = torch.randn(weight_bytes // 4)
    memory = weight_bytes / best_of(opts.repeats, big.sum) / 1e9
    del big
    print(f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; "
          f"MKL 512x576x1536: {gemm:.1f} GFLOP/s; sum over {weight_bytes / 1e6:.0f} MB: {memory:.1f} GB/s")
    print(f"{'rows':>5} {'path':11} {'ms':>8} {'GB/s':>6} {'GFLOP/s':>8}")
    for rows in (int(r) for r in opts.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
        for name, fn in [("torch", F.linear), *paths]:
            t = best_of(opts.repeats, lambda: [fn(xs[w.shape[1]], w) for w in weights])
            print(f"{rows:5d} {name:11} {t * 1e3:8.1f} {weight_bytes / t / 1e9:6.1f} "
                  f"{2 * rows * params / t / 1e9:8.1f}", flush=True)


if __name__ == "__main__":
    main()
