"""x @ w^T in bf16 on the CPU through kernels/csrc/cpu_gemm_bf16.c, for decode steps' few rows.

Why: torch's bf16 linear with one row reads a 576x1536 weight at about 0.8 GB/s where the
machine streams memory at about 20 GB/s (issue 26's measurements; bench/bench_gemm.py --dtype
bfloat16 has this machine's). The kernel reads each weight row once for every row of x and
accumulates in fp32, so few rows run at the speed the weights stream in.

The instruction set is chosen at run time: AMX tiles where the CPU has them and Linux grants
the process their state (arch_prctl), AVX512-BF16 dot products where it has those, else AVX2 +
FMA (bf16 widened to fp32 by a shift), else none (available() is False and the caller uses
torch). One library holds every path (per-function target attributes), so it builds and loads
on any x86-64 CPU.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemm_bf16.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {3: "AMX-BF16", 2: "AVX512-BF16", 1: "AVX2+FMA"}

_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_bf16_isa", "pagoda_bf16_xwt",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
     ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    ISA_NAMES, "using torch's bf16 matmul")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


def xwt(x: torch.Tensor, w: torch.Tensor, isa: int | None = None, few_tiles: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N], bf16 CPU tensors whose rows are contiguous. few_tiles:
    1-4 rows in the AVX512-BF16 4 x 4 tiles instead of one weight row at a time (which is faster
    is the CPU's: worker/model/cpu_matmul.py). Call only after available() returned True."""
    M, K = x.shape
    N = w.shape[0]
    x, w = cbuild.row_major(x, w)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    if M and N:
        _kernel.fn(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(),
                   N, M, N, K, torch.get_num_threads(), isa or _kernel.best, int(few_tiles))
    return out


def greedy(x: torch.Tensor, w: torch.Tensor, few_tiles: bool = False, isa: int | None = None) -> torch.Tensor | None:
    """The index of each row's largest product, int64 [M]: torch's max(dim=-1) over xwt(x, w,
    few_tiles=few_tiles, isa=isa) without writing the [M, N] logits (kernels/csrc/cpu_bf16_greedy.h);
    None where the path has none (AVX2: no AVX512-BF16). x [M, K], w [N, K]: bf16 CPU tensors
    with contiguous rows. Call only after available() returned True."""
    M, K = x.shape
    N = w.shape[0]
    isa = isa or _kernel.best
    if not M or not N or isa < 2:
        return None
    x, w = cbuild.row_major(x, w)
    out = torch.empty(M, dtype=torch.int64)
    fn = _kernel.function("pagoda_bf16_greedy", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_int, ctypes.c_void_p], ctypes.c_int)
    if fn(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, torch.get_num_threads(), isa,
          int(few_tiles), out.data_ptr()) != 0:
        return None
    return out


def agrees_with_reference() -> bool:
    """The best path against float64 on small random products (the start-up check): the shared
    one of 3 rows, and one of 20 rows, K a multiple of 32 and 70 weight rows, which takes the AMX
    tiles (their 32-row groups and a tail of 6) where the CPU has them; and greedy's indices
    against the max of those products' logits, both ways for few rows."""
    from pagoda.kernels.reference import matmul_within, xwt_agrees
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 96, generator=g).bfloat16(), torch.randn(70, 96, generator=g).bfloat16()
    return (xwt_agrees(xwt, torch.bfloat16, 2.0 ** -7) and matmul_within(xwt(x, w), x, w, 2.0 ** -7)
            and all(_greedy_agrees(x[:m], w, tiles) for m in (3, 20) for tiles in (False, True)))


def _greedy_agrees(x: torch.Tensor, w: torch.Tensor, few_tiles: bool) -> bool:
    """greedy's indices are torch's max over xwt's logits (where greedy has a path)."""
    got = greedy(x, w, few_tiles)
    return got is None or torch.equal(got, xwt(x, w, few_tiles=few_tiles).float().max(dim=-1).indices)


_kernel.check = agrees_with_reference
