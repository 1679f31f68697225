"""--quantization int8: weight-only int8 per output channel. The reference is transformers' model
in float64 with the same dequantized weights (a tied vocabulary projection quantized apart from
the embedding, whose lookup keeps its float rows): greedy output equal to it and logits within a
bound, on tiny random checkpoints of each architecture variant (bench/quantized_accuracy.py runs
the real model: 8 prompts of 64 tokens)."""
from __future__ import annotations

import copy

import pytest
import torch

from launch.flag_errors import FlagError
from kernels import cpu_gemm_int8
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
def test_int8_greedy_and_logits_equal_float64_on_the_dequantized_weights(variant, tmp_path):
    hf = make_hf_model(variant)
    runner = ModelRunner(runner_args(save_model(hf, tmp_path / variant), "--quantization", "int8"))
    linears = [m for m in runner.model.modules() if getattr(m, "w8", None) is not None]
    assert linears and all(m.weight is None and m.w8.dtype == torch.int8 for m in linears)
    assert_greedy_equals_reference(runner, dequantized_float64(hf), PROMPTS, NEW_TOKENS)


def test_int8_is_refused_where_it_cannot_run(tmp_path):
    hf = make_hf_model("llama")
    with pytest.raises(FlagError, match="--quantization int8 runs on the CPU, with --dtype float32"):
        ModelRunner(runner_args(save_model(hf, tmp_path / "m"), "--quantization", "int8",
                                "--dtype", "bfloat16"))
