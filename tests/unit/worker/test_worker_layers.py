"""worker.model.layers against transformers' own functions, bit for bit where the arithmetic is the same,
and the attention backend as an interface the model calls without asking which one it is."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import worker.startup.stages
from pagoda.kernels import cpu_gemm, cpu_pointwise
from worker.model.attention_backends import TorchBackend
from worker.model.cpu_matmul import CpuMatmul
from tests.plan_driver import PlanDriver
from tests.worker_tiny_models import make_hf_model, runner_args, save_model
from worker.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary
from worker.model.llama import _pair_rotary_halves
from worker.runner import ModelRunner

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_with_residual_is_hf_bit_for_bit(dtype, monkeypatch):
    """torch's ops (bf16 too where kernels/csrc/cpu_pointwise.c is off; its own tests compare it with
    these ops and float64)."""
    monkeypatch.setattr(cpu_pointwise, "runs_on", lambda x: False)
    hidden = 96
    ours, hf = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=GEN))
        hf.weight.copy_(ours.weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = torch.randn(7, hidden, generator=GEN).to(dtype)
    residual = torch.randn(7, hidden, generator=GEN).to(dtype)
    want_sum = x + residual
    with torch.no_grad():
        assert torch.equal(ours(x.clone()), hf(x))
        fresh = x.clone()
        out, new_residual = ours(fresh, residual)
        assert torch.equal(new_residual, want_sum) and new_residual is fresh  # summed in place
        assert torch.equal(out, hf(want_sum))


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rotary_on_paired_heads_is_hf_rotate_half_bit_for_bit(scaling):
    heads, head_dim = 5, 64
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 17, 100, 3, 255, 40, 41])
    x = torch.randn(len(positions), heads, head_dim, generator=GEN)  # HF's layout: halves
    cis = rotary.cis[positions]
    cos, sin = torch.cat([cis.real] * 2, -1)[None], torch.cat([cis.imag] * 2, -1)[None]
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)

    def paired(t):  # each head's dims as load_weights lays out q_proj and k_proj rows
        return _pair_rotary_halves(t.reshape(-1, head_dim).T, head_dim).T.reshape(t.shape).contiguous()

    got = apply_rotary(paired(x), rotary(positions))
    assert torch.equal(got, paired(want[0].transpose(0, 1)))


def test_rotary_keeps_the_dtype_and_a_strided_input():
    rotary = RotaryEmbedding(32, 64, 10000.0)
    qkv = torch.randn(4, 7 * 32, generator=GEN)
    qk = qkv[:, :5 * 32].view(4, 5, 32)                              # a view into a fused output
    exact = apply_rotary(qk, rotary(torch.arange(4)))
    half = apply_rotary(qk.bfloat16(), rotary(torch.arange(4)))
    assert half.dtype == torch.bfloat16 and (half.float() - exact).abs().max() < 0.05


def test_bf16_norms_rotary_and_silu_take_the_pointwise_kernels_where_they_run(monkeypatch):
    """On a CPU with the kernels, a bf16 layer's pointwise parts are one C call each (the rotary
    turning q and k in place in the fused projection's rows); fp32 stays on torch's ops."""
    if not cpu_pointwise.available():
        pytest.skip("no pointwise kernels on this CPU")
    calls = []
    for name in ("rms_norm", "rotary_", "silu_mul"):
        real = getattr(cpu_pointwise, name)
        monkeypatch.setattr(cpu_pointwise, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    norm, rotary = RMSNorm(64, 1e-5).to(torch.bfloat16), RotaryEmbedding(32, 64, 10000.0)
    qkv = torch.randn(3, 5 * 32, generator=GEN).bfloat16()
    qk = qkv[:, :4 * 32].view(3, 4, 32)
    assert apply_rotary(qk, rotary(torch.arange(3))) is qk
    norm(torch.randn(3, 64, generator=GEN).bfloat16(), torch.randn(3, 64, generator=GEN).bfloat16())
    SiluAndMul()(torch.randn(3, 64, generator=GEN).bfloat16())
    assert calls == ["rotary_", "rms_norm", "silu_mul"]
    norm.float()(torch.randn(3, 64, generator=GEN))
    SiluAndMul()(torch.randn(3, 64, generator=GEN))
    assert calls == ["rotary_", "rms_norm", "silu_mul"]


def test_silu_and_mul_is_hf_bit_for_bit():
    x = torch.randn(6, 2 * 48, generator=GEN)
    gate, up = x.chunk(2, -1)
    assert torch.equal(SiluAndMul()(x), F.silu(gate) * up)


class SpyBackend:
    """Any object with forward() is a backend: this one counts calls and hands them on."""
    name = "spy"

    def __init__(self) -> None:
        self.inner, self.calls = TorchBackend(), 0

    def forward(self, q, k, v, kv_cache, meta, scale):
        self.calls += 1
        return self.inner.forward(q, k, v, kv_cache, meta, scale)


def test_the_model_calls_the_backend_only_through_forward(tmp_path, monkeypatch):
    folder = save_model(make_hf_model("llama"), tmp_path)
    want = PlanDriver(ModelRunner(runner_args(folder))).generate([[5, 6, 7, 8], [9]], 3)
    spy = SpyBackend()
    monkeypatch.setattr(worker.startup.stages, "select_backend", lambda name, device_type: spy)
    runner = ModelRunner(runner_args(folder))
    calls_at_start = spy.calls                                       # start-up measurements
    got = PlanDriver(runner).generate([[5, 6, 7, 8], [9]], 3)
    assert [s.output for s in got] == [s.output for s in want]
    assert spy.calls - calls_at_start == 3 * runner.config.num_layers  # 3 steps x 2 layers


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_logits_equal_float64(rows, kernel, monkeypatch):
    """The CPU logits product: through kernels/csrc/cpu_gemm.c, or without it in slices of the
    vocabulary written in place; every column, the last partial slice's too, must hold the
    float64 product's value."""
    from worker.model.llama import LlamaForCausalLM
    monkeypatch.setattr("worker.model.llama._VOCAB_SLICE", 96)
    monkeypatch.setattr("worker.model.layers.CPU", CpuMatmul(1024 if kernel and cpu_gemm.available() else 0))
    vocab, hidden = 1000, 64                      # 10 full slices and a partial one
    weight = torch.randn(vocab, hidden, generator=GEN)
    h = torch.randn(rows, hidden, generator=GEN)
    model = LlamaForCausalLM.__new__(LlamaForCausalLM)
    model.config = type("C", (), {"tie_word_embeddings": False})()
    model.lm_head = type("L", (), {"weight": weight})()
    got = LlamaForCausalLM.compute_logits(model, h)
    want = h.double() @ weight.double().t()
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("widen", [False, True], ids=["torch", "widened"])
@pytest.mark.parametrize("rows", [1, 4, 5, 300])
def test_bf16_logits_go_through_the_bf16_kernel_or_fp32_and_equal_float64(rows, widen, monkeypatch):
    """A bf16 step's vocabulary projection, the largest matmul of a single stream's step: through
    kernels/csrc/cpu_gemm_bf16.c up to its bound's rows; past it, widened to fp32 where the CPU has
    no bf16 instructions, else torch's slices; within bf16's rounding of the float64 product."""
    from pagoda.kernels import cpu_gemm_bf16
    from worker.model.llama import LlamaForCausalLM
    if not cpu_gemm_bf16.available():
        pytest.skip(f"no bf16 kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    # The fp32 leg through the fp32 kernel where it runs.
    # (1-4 rows in the 4 x 4 tiles or not: either way, as the choice says)
    monkeypatch.setattr("worker.model.layers.CPU", CpuMatmul(1024 if cpu_gemm.available() else 0, 4, widen, widen))
    calls, widened = [], []
    real = cpu_gemm_bf16.xwt
    monkeypatch.setattr(cpu_gemm_bf16, "xwt", lambda x, w, **kw: calls.append((x.shape, kw)) or real(x, w, **kw))
    real_f = cpu_gemm.xwt
    monkeypatch.setattr(cpu_gemm, "xwt", lambda x, w: widened.append(x.dtype) or real_f(x, w))
    vocab, hidden = 1000, 64
    weight = torch.randn(vocab, hidden, generator=GEN).bfloat16()
    h = torch.randn(rows, hidden, generator=GEN).bfloat16()
    model = LlamaForCausalLM.__new__(LlamaForCausalLM)
    model.config = type("C", (), {"tie_word_embeddings": False})()
    model.lm_head = type("L", (), {"weight": weight})()
    got = LlamaForCausalLM.compute_logits(model, h)
    assert calls == ([((rows, hidden), {"few_tiles": widen})] if rows <= 4 else [])
    fp32_kernel = widen and rows > 4 and cpu_gemm.available()
    assert widened == ([torch.float32] if fp32_kernel else [])
    want = h.double() @ weight.double().t()
    scale = h.double().abs() @ weight.double().abs().t()
    assert got.dtype == torch.float32 and bool(((got.double() - want).abs() <= 2.0 ** -7 * scale + 1e-6).all())


@pytest.mark.parametrize("rows", [3, 8, 9, 200])
def test_bf16_linear_past_the_kernels_rows_is_widened_to_fp32_where_the_cpu_lacks_bf16(rows, monkeypatch):
    """worker.model.layers.linear on bf16 operands without bf16 instructions: the bf16 kernel up to its
    rows, then fp32 (the fp32 kernel or MKL) on widened operands, the bias added; a bf16 result
    within bf16's rounding of the float64 product either way."""
    from pagoda.kernels import cpu_gemm_bf16
    from worker.model.layers import linear
    if not cpu_gemm_bf16.available():
        pytest.skip("no bf16 kernel on this CPU")
    calls = []
    monkeypatch.setattr("worker.model.layers.F.linear", lambda x, w, b=None, real=F.linear: calls.append(x.dtype) or real(x, w, b))
    weight = torch.randn(96, 40, generator=GEN).bfloat16()
    b = torch.randn(96, generator=GEN).bfloat16()
    x = torch.randn(rows, 40, generator=GEN).bfloat16()
    monkeypatch.setattr("worker.model.layers.CPU", CpuMatmul(0, 8, True))  # the fp32 leg through MKL, seen by the spy
    got = linear(x, weight, b)
    assert calls == ([] if rows <= 8 else [torch.float32])
    want = x.double() @ weight.double().t() + b.double()
    scale = x.double().abs() @ weight.double().abs().t() + b.double().abs()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert bool(((got.double() - want).abs() <= 2.0 ** -7 * scale + 1e-6).all())


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("rows", [1, 2, 9, 64, 1024, 1025])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_float64(rows, bias, kernel, monkeypatch):
    """worker.model.layers.linear runs up to its bound's rows through kernels/csrc/cpu_gemm.c and more
    through F.linear: both are x W^T + b to float32 rounding, contiguous, in the input's dtype."""
    from worker.model.layers import linear
    # The parametrization straddles the kernel's bound.
    monkeypatch.setattr("worker.model.layers.CPU", CpuMatmul(1024 if kernel and cpu_gemm.available() else 0))
    calls = []
    monkeypatch.setattr(cpu_gemm, "xwt", lambda *a, real=cpu_gemm.xwt: calls.append(1) or real(*a))
    weight = torch.randn(96, 40, generator=GEN)
    b = torch.randn(96, generator=GEN) if bias else None
    x = torch.randn(rows, 40, generator=GEN)
    got = linear(x, weight, b)
    want = x.double() @ weight.double().t() + (b.double() if bias else 0)
    assert got.is_contiguous() and got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert calls == ([1] if kernel and cpu_gemm.available() and rows <= 1024 else [])
