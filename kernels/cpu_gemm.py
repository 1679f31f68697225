"""x @ w^T in fp32 on the CPU through kernels/csrc/cpu_gemm.c, a small AVX2 kernel (with an AVX-512F
path chosen at run time where the CPU has it) built with the system C compiler and called
through ctypes.

Why: on the developers' AVX2 EPYC (2 threads, torch 2.13's MKL), MKL's sgemm runs a step's
projections at a fraction of the machine's rate whenever x has fewer than a few hundred rows,
which is every decode step (bench/bench_gemm.py; docs/benchmarks.md has the figures). This kernel
reads each weight once per 96 rows of x and keeps 12 dot products in registers, so that it runs
near the memory bandwidth with one row and near the FMA peak from a few dozen rows on.

The shared library is built from the source on first use into kernels/build/ (`make install`
does it ahead, for every kernel: `python -m pagoda.kernels.cpu_gemm --build`), named by a hash of the
source and flags, so an edited source is rebuilt and a stale library is never loaded. Without a
compiler, or on a CPU without AVX2 and FMA, available() is False (one log line says why) and the
caller uses torch.

    python -m pagoda.kernels.cpu_gemm --build
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemm.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {2: "AVX-512F", 1: "AVX2+FMA"}

_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "cpu_gemm_isa", "cpu_gemm_xwt",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
     ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    ISA_NAMES, "using torch's matmul")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


def library_path() -> Path:
    return cbuild.library_path(SOURCE, FLAGS)


def build() -> Path:
    """Compiles the library unless the one for this source exists; returns its path."""
    return cbuild.build(SOURCE, FLAGS)


def xwt(x: torch.Tensor, w: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N], fp32 CPU tensors whose rows are contiguous. Call only
    after available() returned True. isa: a path of supported_isas() (default the best)."""
    M, K = x.shape
    N = w.shape[0]
    x, w = cbuild.row_major(x, w)
    out = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        _kernel.fn(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(), N,
                   M, N, K, torch.get_num_threads(), isa or _kernel.best)
    return out


def agrees_with_reference() -> bool:
    """The best path against float64 on a small random product (the start-up check)."""
    from pagoda.kernels.reference import xwt_agrees
    return xwt_agrees(xwt, torch.float32, 1e-5)


_kernel.check = agrees_with_reference


# Every C kernel (kernels/<name>.py) and what the worker does where it cannot be built: `make
# kernels` builds each, and a unit test holds each to building here.
EVERY_KERNEL = (("cpu_gemm", "the worker uses torch's matmul"),
                ("cpu_gemm_bf16", "the worker uses torch's bf16 matmul"),
                ("cpu_gemm_int8", "--quantization int8 multiplies dequantized weights"),
                ("cpu_gemm_gguf", "--quantization q8_0 / q4_1 multiply dequantized weights"),
                ("cpu_decode_attention", "the CPU attention decodes with torch ops"),
                ("cpu_decode_layer", "quantized decode steps run layer by layer in torch"),
                ("cpu_prefill_attention", "the CPU attention prefills with torch ops"),
                ("cpu_pointwise", "bf16 norms, rotary and SiLU run as torch ops"),
                ("grammar_mask", "the worker uses xgrammar's mask kernel"))


if __name__ == "__main__":
    if sys.argv[1:] != ["--build"]:
        sys.exit(__doc__)
    # Every kernel builds on any x86-64, whatever it runs (each picks its path at run time).
    import importlib
    for name, without in EVERY_KERNEL:
        kernel = importlib.import_module(f"pagoda.kernels.{name}")
        try:
            print(f"kernels/{name}: {cbuild.build(kernel.SOURCE, kernel.FLAGS)}")
        except RuntimeError as e:  # a missing compiler costs speed, not the install
            print(f"kernels/{name}: not built ({e}); {without}")
