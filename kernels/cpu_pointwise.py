"""The pointwise parts of a bf16 layer in C (kernels/csrc/cpu_pointwise.c): the residual sum and
RMSNorm, the rotary turn of q and k in place, SiLU(gate) * up; one call each over a step's rows,
rounding where torch's bf16 ops round. worker/model/layers.py takes them for bf16 activations on a CPU
where they run; fp32 stays on torch's ops, whose bits match transformers'.

The instruction set is chosen at run time: AVX-512 with AVX512-BF16 (its rounding instruction), else
AVX-512 (F, BW, VL), else AVX2 + FMA, else none (available() is
False). One library holds both paths.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_pointwise.c"
FLAGS = cbuild.EXP_KERNEL_FLAGS
ISA_NAMES = {3: "AVX512-BF16", 2: "AVX-512", 1: "AVX2+FMA"}

_c = ctypes
_NORM_ARGS = [_c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_float, _c.c_int64, _c.c_int, _c.c_void_p, _c.c_int,
              _c.c_int]
_ROTARY_ARGS = [_c.c_void_p, _c.c_int64, _c.c_int, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_int, _c.c_int]
_SILU_ARGS = [_c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int64, _c.c_int, _c.c_int]
_kernel = cbuild.IsaKernel(SOURCE, FLAGS, "pagoda_pointwise_isa", "pagoda_rms_norm_bf16", _NORM_ARGS,
                           ISA_NAMES, "bf16 norms, rotary and SiLU by torch's ops")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernels serve these activations here (bf16 on a CPU)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             isa: int | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight for x [T, H]; with residual, x += residual first, in place (x must be
    contiguous then). Call only where runs_on(x)."""
    if residual is None:
        x = x.contiguous()
    elif not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("the residual sum is written into x: x and residual must be contiguous")
    T, H = x.shape
    weight = weight.to(torch.bfloat16).contiguous()
    out = torch.empty_like(x)
    _kernel.fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
               T, H, out.data_ptr(), torch.get_num_threads(), isa or _kernel.best)
    return out


def rotary_(x: torch.Tensor, cis: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """x [T, heads, D] (whose rows may be a slice of wider ones, as q and k in the fused qkv
    projection) turned in place by cis [T, 1, D/2] (complex: cos + i sin), each pair (2i, 2i + 1)
    a complex number; returns x. Call only where runs_on(x)."""
    T, heads, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        raise ValueError("rotary_ turns heads of contiguous pairs, in rows of any stride")
    turns = torch.view_as_real(cis.reshape(T, D // 2)).contiguous()
    fn = _kernel.function("pagoda_rotary_bf16", _ROTARY_ARGS)
    fn(x.data_ptr(), x.stride(0), heads, D, turns.data_ptr(), T, torch.get_num_threads(), isa or _kernel.best)
    return x


def silu_mul(gate_up: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I] = [gate | up]. Call only where runs_on(gate_up)."""
    gate_up = gate_up.contiguous()
    T, width = gate_up.shape
    out = torch.empty(T, width // 2, dtype=torch.bfloat16)
    fn = _kernel.function("pagoda_silu_mul_bf16", _SILU_ARGS)
    fn(gate_up.data_ptr(), width // 2, out.data_ptr(), T, torch.get_num_threads(), isa or _kernel.best)
    return out


def agrees_with_reference() -> bool:
    """The best path's norm, rotary and SiLU against float64 on small random rows, within bf16's
    rounding (the start-up check)."""
    from pagoda.kernels import reference
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 40, generator=g).bfloat16(), torch.randn(3, 40, generator=g).bfloat16()
    w = (torch.rand(40, generator=g) + 0.5).bfloat16()
    summed = (x.double() + res.double())
    norm = rms_norm(x.clone(), w, 1e-5, res)
    angles = torch.rand(3, 1, 4, generator=g, dtype=torch.float64) * 6
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    qk = torch.randn(3, 2, 8, generator=g).bfloat16()
    turned = rotary_(qk.clone(), cis)
    gu = torch.randn(3, 16, generator=g).bfloat16()
    return bool(reference.within_bf16(norm, reference.rms_norm_float64(summed, w.double(), 1e-5))
                and reference.within_bf16(turned, reference.rotary_float64(qk.double(), cis))
                and reference.within_bf16(silu_mul(gu), reference.silu_mul_float64(gu.double())))


_kernel.check = agrees_with_reference
