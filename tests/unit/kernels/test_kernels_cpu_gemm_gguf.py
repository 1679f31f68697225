"""kernels/cpu_gemm_gguf.py against float64 on the dequantized weights, on every instruction set
this CPU has (the test names them); the formats against gguf's own dequantizer and a block
written by hand (the nibble order)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.kernels import cpu_gemm_gguf

GEN = torch.Generator().manual_seed(0)
KINDS = ["q8_0", "q4_1"]


def test_q4_1_block_layout():
    """fp16 d, fp16 m, then 16 bytes: weight j in the low nibble of byte j, weight 16 + j in its
    high nibble (ggml-quants.c's dequantize_row_q4_1)."""
    head = np.array([0.5, -1.0], dtype=np.float16).view(np.uint8)
    qs = np.array([j | (15 - j) << 4 for j in range(16)], dtype=np.uint8)
    blocks = torch.from_numpy(np.concatenate([head, qs])[None])
    want = torch.tensor([0.5 * j - 1.0 for j in range(16)] + [0.5 * (15 - j) - 1.0 for j in range(16)])
    for dequantize in (cpu_gemm_gguf.dequantize, cpu_gemm_gguf.dequantize_torch):
        assert torch.equal(dequantize(blocks, "q4_1"), want[None])
    x = torch.zeros(1, 32)
    x[0, 17] = 1.0
    for isa in cpu_gemm_gguf.supported_isas():  # the int8 paths round x: 1 is 127 * (1 / 127)
        assert cpu_gemm_gguf.xwt(x, blocks, "q4_1", isa=isa).item() == pytest.approx(0.5 * 14 - 1.0, abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_is_ggufs_and_dequantize_is_exact(kind):
    from gguf.quants import dequantize as gguf_dequantize

    w = torch.randn(37, 96, generator=GEN)
    w[3] = 0  # an all-zero row: d = 0
    blocks = cpu_gemm_gguf.quantize(w, kind)
    assert blocks.dtype == torch.uint8 and blocks.shape == (37, 3 * cpu_gemm_gguf.FORMATS[kind][1])
    theirs = torch.from_numpy(gguf_dequantize(blocks.numpy(), cpu_gemm_gguf.ggml_type(kind)))
    exact = cpu_gemm_gguf.dequantize(blocks, kind, torch.float64)
    step = (w.abs().amax() / 127 if kind == "q8_0" else (w.amax() - w.amin()) / 15).item()
    assert bool(((exact - w.double()).abs() <= step).all())
    assert bool((exact[3] == 0).all())
    for ours in (cpu_gemm_gguf.dequantize(blocks, kind), cpu_gemm_gguf.dequantize_torch(blocks, kind)):
        # fp32: the exact value rounded, once or twice (d * q, then + m)
        torch.testing.assert_close(ours.double(), exact, atol=1e-7, rtol=2 ** -23)
        torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=2 ** -23)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        cpu_gemm_gguf.quantize(torch.ones(2, 40), kind)


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 12, 16, 64, 100])
@pytest.mark.parametrize("k", [576, 1536, 32, 96])
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_equals_float64_on_every_isa_here(kind, rows, k):
    if not cpu_gemm_gguf.available():
        pytest.skip(f"no GGUF block kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    x = torch.randn(rows, k, generator=GEN)
    blocks = cpu_gemm_gguf.quantize(torch.randn(301, k, generator=GEN), kind)
    w = cpu_gemm_gguf.dequantize(blocks, kind, torch.float64)
    want = x.double() @ w.t()
    assert torch.equal(cpu_gemm_gguf.reference(x, blocks, kind), want)

    def bound(x):  # fp32 weights (rounded once) and fp32 sums: a few ulps of the sum of |terms|
        return (x.double().abs() @ w.abs().t()) * 1e-6 + 1e-6
    isas = cpu_gemm_gguf.supported_isas()
    print(f"{kind} kernel paths here: {[cpu_gemm_gguf.ISA_NAMES[i] for i in isas]}")
    for isa in isas:
        # An int8 path is exact on x as it rounds it (integer sums), then fp32 scales and sums.
        got = cpu_gemm_gguf.xwt(x, blocks, kind, isa=isa).double()
        exact = cpu_gemm_gguf.reference(x, blocks, kind, isa)
        assert bool(((got - exact).abs() <= bound(x)).all()), cpu_gemm_gguf.ISA_NAMES[isa]
        if isa in cpu_gemm_gguf.INT8_ISAS:  # and x's rounding costs at most d / 2 a value
            _, d, _ = cpu_gemm_gguf.quantize_activations(x)
            half_step = (d.double() / 2).repeat_interleave(32, dim=1)
            assert bool(((got - want).abs() <= half_step @ w.abs().t() + bound(x)).all())
    # A column slice of a wider activation keeps its row stride.
    wide = torch.randn(rows, k + 5, generator=GEN)[:, :k]
    got = cpu_gemm_gguf.xwt(wide, blocks, kind).double()
    exact = cpu_gemm_gguf.reference(wide, blocks, kind, cpu_gemm_gguf.best_isa())
    assert bool(((got - exact).abs() <= bound(wide)).all())


def test_activation_rounding_is_numpys():
    """The int8 paths' x (llama.cpp's Q8_1): per block of 32, d = max |x| / 127 and q = rint(x / d)
    in fp32, s = d * sum(q); an all-zero block has d = 0."""
    if not cpu_gemm_gguf.available():
        pytest.skip("no GGUF block kernel on this CPU")
    x = torch.randn(3, 96, generator=GEN) * torch.tensor([1.0, 1e-3, 50.0])[:, None]
    x[1, 32:64] = 0
    x[2, 5] = 0.5 * x[2, :32].abs().max()  # a value on a half step: ties go to even
    q, d, s = cpu_gemm_gguf.quantize_activations(x)
    blocks = x.numpy().reshape(3, 3, 32)
    amax = np.abs(blocks).max(axis=-1)
    want_d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(want_d != 0, np.float32(1) / np.where(want_d != 0, want_d, 1), 0).astype(np.float32)
    want_q = np.rint(blocks * inv[..., None]).astype(np.int8)
    assert np.array_equal(q.numpy().reshape(3, 3, 32), want_q)
    assert np.array_equal(d.numpy(), want_d) and d[1, 1] == 0
    assert np.array_equal(s.numpy(), want_d * want_q.astype(np.int32).sum(-1).astype(np.float32))
    assert int(q.abs().max()) == 127
