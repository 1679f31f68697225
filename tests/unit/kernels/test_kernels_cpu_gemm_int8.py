"""kernels/cpu_gemm_int8.py against float64 on the dequantized weights, on every instruction set
this CPU has (the test names them), and the quantization's own round trip."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_gemm_int8

GEN = torch.Generator().manual_seed(0)


def test_quantize_round_trips_within_half_a_step():
    w = torch.randn(37, 200, generator=GEN)
    w[3] = 0  # an all-zero row keeps a usable scale
    w8, scale = cpu_gemm_int8.quantize(w)
    assert w8.dtype == torch.int8 and scale.shape == (37,) and bool((scale > 0).all())
    err = (cpu_gemm_int8.dequantize(w8, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert int(w8.abs().max()) == 127


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 12, 16, 64, 100])
@pytest.mark.parametrize("k", [576, 1536, 200, 205, 7])
def test_the_kernel_equals_float64_on_every_isa_here(rows, k):
    if not cpu_gemm_int8.available():
        pytest.skip(f"no int8 kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    x = torch.randn(rows, k, generator=GEN)
    w8, scale = cpu_gemm_int8.quantize(torch.randn(301, k, generator=GEN))
    want = cpu_gemm_int8.reference(x, w8, scale)

    def bound(x):  # fp32 accumulation of exact products: a few ulps of the sum of |terms|
        return (x.double().abs() @ (w8.double().abs() * scale.double()[:, None]).t()) * 1e-6 + 1e-6
    isas = cpu_gemm_int8.supported_isas()
    print(f"int8 kernel paths here: {[cpu_gemm_int8.ISA_NAMES[i] for i in isas]}")
    for isa in isas:
        got = cpu_gemm_int8.xwt(x, w8, scale, isa=isa).double()
        assert bool(((got - want).abs() <= bound(x)).all()), cpu_gemm_int8.ISA_NAMES[isa]
    # A column slice of a wider activation keeps its row stride.
    wide = torch.randn(rows, k + 5, generator=GEN)[:, :k]
    got = cpu_gemm_int8.xwt(wide, w8, scale).double()
    assert bool(((got - cpu_gemm_int8.reference(wide, w8, scale)).abs() <= bound(wide)).all())
