"""Weight-only int8 on the CPU (kernels/csrc/cpu_gemm_int8.c): x (fp32) @ (scale * w_int8)^T, one
scale per output channel, symmetric. For decode steps, which read every weight once per step:
int8 weights are a quarter of fp32's bytes.

quantize() is the whole format: scale = max |w[n, :]| / 127 (1 for an all-zero row), w_int8 =
round(w / scale). reference() is the same product in float64 on the dequantized weights, which
the kernel is held to. The instruction set is chosen at run time: AVX-512F, else AVX2 + FMA,
else none (available() is False and the caller multiplies the dequantized weights with torch).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemm_int8.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {2: "AVX-512F", 1: "AVX2+FMA"}

_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_int8_isa", "pagoda_int8_xwt",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
     ctypes.c_int],
    ISA_NAMES, "multiplying dequantized weights")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N]) of a weight [N, K]."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w8.to(torch.float32) * scale[:, None]).to(dtype)


def xwt(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ (scale * w8 [N, K])^T -> [M, N] fp32. Call only after available()."""
    M, K = x.shape
    N = w8.shape[0]
    x, w8 = cbuild.row_major(x, w8)
    out = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        _kernel.fn(x.data_ptr(), x.stride(0), w8.data_ptr(), w8.stride(0), scale.data_ptr(),
                   out.data_ptr(), N, M, N, K, torch.get_num_threads(), isa or _kernel.best)
    return out


def reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (w8.double() * scale.double()[:, None]).t()


def agrees_with_reference() -> bool:
    """The best path against float64 on a small random product (the start-up check)."""
    from pagoda.kernels.reference import matmul_within
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g)
    w8, scale = quantize(torch.randn(37, 200, generator=g))
    return matmul_within(xwt(x, w8, scale), x, w8.double() * scale.double()[:, None], 1e-5)


_kernel.check = agrees_with_reference
