"""The CPU projections of one SmolLM2-135M step (30 layers' qkv, o, gate_up and down, and the LM
head: 538 MB of fp32 weights, far beyond any cache), by number of rows, through torch's
F.linear (MKL) and through kernels/csrc/cpu_gemm.c, interleaved in one run; best of --repeats.

    .venv/bin/python -m bench.bench_gemm [--rows 1,4,8,16,32,64,128,256,512,1024,2048] [--threads 2]
    .venv/bin/python -m bench.bench_gemm --dtype bfloat16 --rows 1,2,4,8,16,32
    .venv/bin/python -m bench.bench_gemm --quantization q4_1 --rows 1,16,64,128

--dtype bfloat16 runs the same set in bf16 (269 MB) through torch and kernels/csrc/cpu_gemm_bf16.c,
on each instruction-set path this CPU has. --quantization int8 / q8_0 / q4_1 runs it quantized
(134, 142 and 84 MB) through kernels/csrc/cpu_gemm_int8.c or cpu_gemm_gguf.c on each path, and
"torch" is then the weights dequantized and multiplied by F.linear (what a prefill chunk does).

It prints each path's time for the whole set, the weight bytes streamed per second and the
arithmetic rate, next to a 512 x 576 x 1536 MKL GEMM and a 540 MB sum (the machine's memory rate)
measured in the same run.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8

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
    ap.add_argument("--quantization", choices=["int8", "q8_0", "q4_1"], default=None)
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    if opts.quantization:
        paths = quantized_paths(opts.quantization)
    elif dtype == torch.float32:
        if not cpu_gemm.available():
            sys.exit("kernels/csrc/cpu_gemm.c cannot run here (no AVX2 or no C compiler)")
        paths = [("kernel", cpu_gemm.xwt)]
    else:
        if not cpu_gemm_bf16.available():
            sys.exit("kernels/csrc/cpu_gemm_bf16.c cannot run here (no AVX2 or no C compiler)")
        paths = [(cpu_gemm_bf16.ISA_NAMES[i], lambda x, w, i=i: cpu_gemm_bf16.xwt(x, w, i))
                 for i in cpu_gemm_bf16.supported_isas()]
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for n, k in SHAPES]
    params = sum(w.numel() for w in weights)
    if opts.quantization:  # each weight becomes what its paths take
        weights = [paths[0][2](w) for w in weights]
    weight_bytes = sum(t.numel() * t.element_size() for w in weights for t in (w if isinstance(w, tuple) else (w,)))

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
        for name, fn, *_ in ([] if opts.quantization else [("torch", F.linear)]) + paths:
            t = best_of(opts.repeats, lambda: [fn(xs[k], w) for (_, k), w in zip(SHAPES, weights)])
            print(f"{rows:5d} {name:11} {t * 1e3:8.1f} {weight_bytes / t / 1e9:6.1f} "
                  f"{2 * rows * params / t / 1e9:8.1f}", flush=True)


def quantized_paths(kind: str) -> list:
    """(name, fn(x, weight), quantize(float weight)) for torch on the dequantized weights and for
    each instruction-set path of the kind's kernel."""
    if kind == "int8":
        mod, quantize = cpu_gemm_int8, cpu_gemm_int8.quantize
        dequantize = lambda q: cpu_gemm_int8.dequantize(*q)  # noqa: E731
        xwt = lambda x, q, isa: cpu_gemm_int8.xwt(x, *q, isa=isa)  # noqa: E731
    else:
        mod, quantize = cpu_gemm_gguf, lambda w: cpu_gemm_gguf.quantize(w, kind)  # noqa: E731
        dequantize = lambda q: cpu_gemm_gguf.dequantize(q, kind)  # noqa: E731
        xwt = lambda x, q, isa: cpu_gemm_gguf.xwt(x, q, kind, isa=isa)  # noqa: E731
    if not mod.available():
        sys.exit(f"the {kind} kernel cannot run here (no AVX2 or no C compiler)")
    return [("torch", lambda x, q: F.linear(x, dequantize(q)), quantize)] + [
        (mod.ISA_NAMES[i], lambda x, q, i=i: xwt(x, q, i), quantize) for i in mod.supported_isas()]


if __name__ == "__main__":
    main()
