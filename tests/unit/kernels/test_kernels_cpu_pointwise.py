"""kernels/csrc/cpu_pointwise.c (bf16 residual sum + RMSNorm, rotary, SiLU * up) on every
instruction set this CPU has, one thread and two: against float64 within bf16's rounding, and
against torch's bf16 ops (worker/model/layers.py's other path, HF's arithmetic) within one bf16 step of
each value, with at most a few in a thousand differing at all (the statistics summed in another
order)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_pointwise, reference

pytestmark = pytest.mark.skipif(not cpu_pointwise.available(), reason="no pointwise kernels on this CPU")
GEN = torch.Generator().manual_seed(0)
ISAS = cpu_pointwise.supported_isas() if cpu_pointwise.available() else []


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors are (same-sign values; 0 where equal, and where
    both are below 2^-100: SiLU of -100 is 4e-42 in torch and 2e-36 here, both nothing next to
    the other values)."""
    apart = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    return apart.masked_fill((got.float().abs() < 2.0 ** -100) & (want.float().abs() < 2.0 ** -100), 0)


def _close_to_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) <= 0.005, apart.max()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 576 spreads over the threads
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: cpu_pointwise.ISA_NAMES[i])
def test_residual_sum_and_rms_norm(isa, rows, threads):
    x = (torch.randn(rows, 576, generator=GEN) * 3).bfloat16()
    residual = torch.randn(rows, 576, generator=GEN).bfloat16()
    w = (torch.rand(576, generator=GEN) + 0.5).bfloat16()
    fresh = x.clone()
    out = cpu_pointwise.rms_norm(fresh, w, 1e-5, residual, isa=isa)
    summed = x + residual                                     # torch's bf16 add: one rounding
    assert torch.equal(fresh, summed)                         # the sum, in place
    assert reference.within_bf16(out, reference.rms_norm_float64(summed, w, 1e-5))
    h = summed.float()
    torch_ops = (h * h.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()).bfloat16() * w
    _close_to_torch(out, torch_ops)
    alone = cpu_pointwise.rms_norm(x, w, 1e-5, isa=isa)      # no residual: x is left alone
    assert torch.equal(x, x.clone()) and reference.within_bf16(alone, reference.rms_norm_float64(x, w, 1e-5))


@pytest.mark.parametrize("rows", [1, 4, 700])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: cpu_pointwise.ISA_NAMES[i])
def test_rotary_turns_q_and_k_in_their_rows_of_the_fused_projection(isa, rows, threads):
    qkv = torch.randn(rows, 15 * 64, generator=GEN).bfloat16()
    before = qkv.clone()
    qk = qkv[:, :12 * 64].view(rows, 12, 64)                  # 9 q heads and 3 k heads; v after
    angles = torch.rand(rows, 1, 32, generator=GEN, dtype=torch.float64) * 100
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    assert cpu_pointwise.rotary_(qk, cis, isa=isa) is qk
    assert torch.equal(qkv[:, 12 * 64:], before[:, 12 * 64:])  # v untouched
    want = reference.rotary_float64(before[:, :12 * 64].view(rows, 12, 64), cis)
    assert reference.within_bf16(qk, want, roundings=1)
    pairs = torch.view_as_complex(before[:, :12 * 64].view(rows, 12, 32, 2).float())
    _close_to_torch(qk, torch.view_as_real(pairs * cis).flatten(-2).bfloat16())


@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: cpu_pointwise.ISA_NAMES[i])
def test_silu_times_up(isa, rows, threads):
    gate_up = (torch.randn(rows, 2 * 1536, generator=GEN) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's ends
    out = cpu_pointwise.silu_mul(gate_up, isa=isa)
    assert reference.within_bf16(out, reference.silu_mul_float64(gate_up), roundings=2)
    gate, up = gate_up.chunk(2, -1)
    _close_to_torch(out, F.silu(gate) * up)
