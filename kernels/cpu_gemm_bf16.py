"""x @ w^T in bf16 on the CPU through kernels/csrc/cpu_gemm_bf16.c, for decode steps' few rows.

Why: torch's bf16 linear with one row reads a 576x1536 weight at about 0.8 GB/s where the
machine streams memory at about 20 GB/s (issue 26's measurements; bench/bench_gemm.py --dtype
bfloat16 has this machine's). The kernel reads each weight row once for every row of x and
accumulates in fp32, so few rows run at the speed the weights stream in.

The instruction set is chosen at run time: AVX512-BF16 dot products where the CPU has them,
else AVX2 + FMA (bf16 widened to fp32 by a shift), else none (available() is False and the
caller uses torch). One library holds both paths (per-function target attributes), so it
builds and loads on any x86-64 CPU.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kernels import cbuild

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemm_bf16.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {2: "AVX512-BF16", 1: "AVX2+FMA"}

_lib: ctypes.CDLL | None = None
_isa = 0
_tried = False


def isa() -> str | None:
    """The instruction set the kernel runs on here, or None where it does not run."""
    return ISA_NAMES.get(_isa) if available() else None


def available(force_isa: int | None = None) -> bool:
    """Loads the library on first call; False (and one log line saying why) where it cannot run.
    force_isa (tests) picks a path the CPU also has."""
    global _lib, _tried, _isa
    if not _tried:
        _tried = True
        try:
            lib = ctypes.CDLL(str(cbuild.build(SOURCE, FLAGS)))
        except (OSError, RuntimeError) as e:
            logger.warning("bf16 CPU matmul kernel off, using torch's: %s", e)
            return False
        _isa = lib.pagoda_bf16_isa()
        if _isa == 0:
            logger.info("bf16 CPU matmul kernel off: the CPU has neither AVX512-BF16 nor AVX2")
            return False
        fn = lib.pagoda_bf16_xwt
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        fn.restype = None
        _lib = lib
    return _lib is not None and _isa > 0


def supported_isas() -> list[int]:
    """Every path this CPU can run, best first (each is tested)."""
    return [i for i in (2, 1) if available() and i <= _isa]


def xwt(x: torch.Tensor, w: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N], bf16 CPU tensors whose rows are contiguous. Call only
    after available() returned True."""
    M, K = x.shape
    N = w.shape[0]
    x, w = cbuild.row_major(x, w)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    if M and N:
        _lib.pagoda_bf16_xwt(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), out.data_ptr(),
                             N, M, N, K, torch.get_num_threads(), isa or _isa)
    return out
