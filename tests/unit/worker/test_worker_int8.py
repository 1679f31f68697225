"""--quantization int8: weight-only int8 per output channel. The reference is transformers' model
in float64 with the same dequantized weights (a tied vocabulary projection quantized apart from
the embedding, whose lookup keeps its float rows): greedy output equal to it and logits within a
bound, on tiny random checkpoints of each architecture variant (bench/quantized_accuracy.py runs
the real model: 8 prompts of 64 tokens)."""
from __future__ import annotations

import copy

import pytest
import torch

import worker.model.layers as layers
from process_life.flag_errors import FlagError
from pagoda.kernels import cpu_decode_layer, cpu_gemm_int8
from worker.model import cpu_matmul
from tests.worker_tiny_models import (VARIANTS, assert_greedy_equals_reference, make_hf_model,
                                      runner_args, save_model)
from worker.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8, 9, 10], [200, 3, 17]]
NEW_TOKENS = 16


def dequantized_float64(hf):
    """hf with every projection's weights replaced by their int8 round trip, in float64."""
    ref = copy.deepcopy(hf).double()
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                tied = name == "lm_head" and ref.config.tie_word_embeddings
                source = ref.model.embed_tokens.weight if tied else module.weight
                w = cpu_gemm_int8.dequantize(*cpu_gemm_int8.quantize(source.float())).double()
                module.weight = torch.nn.Parameter(w)  # the head untied: the embedding stays float
    return ref


@pytest.mark.parametrize("variant", VARIANTS)
def test_int8_greedy_and_logits_equal_float64_on_the_dequantized_weights(variant, tmp_path, monkeypatch):
    """Decode steps in one C call where the model qualifies (no biases), else layer by layer:
    the same reference either way."""
    steps = []
    real = cpu_decode_layer.decode_step
    monkeypatch.setattr(cpu_decode_layer, "decode_step", lambda *a, **k: steps.append(a[3].shape[0]) or real(*a, **k))
    hf = make_hf_model(variant)
    runner = ModelRunner(runner_args(save_model(hf, tmp_path / variant), "--quantization", "int8"))
    linears = [m for m in runner.model.modules() if getattr(m, "w8", None) is not None]
    assert linears and all(m.weight is None and m.w8.dtype == torch.int8 for m in linears)
    fused = runner.model.model.fused_decode
    biases = any(m.bias is not None for m in linears)
    steps.clear()  # start-up's own (the C step's check against float64)
    assert_greedy_equals_reference(runner, dequantized_float64(hf), PROMPTS, NEW_TOKENS)
    if biases or not cpu_decode_layer.available():
        assert fused is None and steps == []
    else:
        assert fused.shape.kind == "int8" and all(torch.equal(w.scales[0], layer.self_attn.qkv_proj.scale)
                                                  for w, layer in zip(fused.weights, runner.model.model.layers))
        assert len(steps) >= NEW_TOKENS - 1  # the decodes of both prompts, one step each


def test_int8_is_refused_where_it_cannot_run(tmp_path):
    hf = make_hf_model("llama")
    with pytest.raises(FlagError, match="--quantization int8 runs on the CPU, with --dtype float32"):
        ModelRunner(runner_args(save_model(hf, tmp_path / "m"), "--quantization", "int8",
                                "--dtype", "bfloat16"))


@pytest.mark.skipif(not cpu_gemm_int8.available(), reason="no int8 kernel on this CPU")
def test_an_int8_runner_bounds_its_layers_and_its_vocabulary_projection_apart(tmp_path, monkeypatch):
    """Its layers' bound is raced on a layer's four projections and the vocabulary projection's on
    its own shape (worker/model/cpu_matmul.py choose_quantized); the logits' projection obeys its own bound."""
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path / "cache"))
    raced = []
    monkeypatch.setattr(cpu_matmul, "measure_quantized",
                        lambda shapes, kind, vocab=False, fp32_rows=0: raced.append((shapes, kind, vocab)) or (3 if vocab else 1))
    for name in ("QUANTIZED_KERNEL_ROWS", "QUANTIZED_VOCAB_KERNEL_ROWS"):  # put back afterwards
        monkeypatch.setattr(layers, name, getattr(layers, name))
    hf = make_hf_model("llama")
    runner = ModelRunner(runner_args(save_model(hf, tmp_path / "m"), "--quantization", "int8"))
    config = hf.config
    h, i = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    assert raced == [(((q + 2 * kv, h), (h, q), (2 * i, h), (h, i)), "int8", False),
                     (((config.vocab_size, h),), "int8", True)]
    kernel = []
    real = cpu_gemm_int8.xwt
    monkeypatch.setattr(cpu_gemm_int8, "xwt", lambda x, w8, *a, **k: kernel.append((x.shape[0], w8.shape[0]))
                        or real(x, w8, *a, **k))
    w8, scale = runner.model.lm_head_int8
    for rows in (3, 4):
        hidden = torch.randn(rows, config.hidden_size)
        torch.testing.assert_close(runner.model.compute_logits(hidden).double(),
                                   hidden.double() @ cpu_gemm_int8.dequantize(w8, scale, torch.float64).t(),
                                   rtol=1e-4, atol=1e-3)
    assert kernel == [(3, config.vocab_size)]
