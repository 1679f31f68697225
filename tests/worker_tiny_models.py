"""Tiny random Llama-family checkpoints for worker tests, and transformers as the reference."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.worker_flags import worker_args

VARIANTS = ("llama", "llama3-tied-bias", "qwen2")


def make_hf_model(variant: str, seed: int = 0):
    """A 2-layer model with weights drawn wider than HF's init, so that logits are far from
    uniform and greedy choices are not decided by rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if variant == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif variant == "llama3-tied-bias":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True,
                                             rope_parameters=rope))
    elif variant == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(variant)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def save_model(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def runner_args(model: Path | str, *extra: str, num_blocks: int = 64):
    return worker_args(["--model", str(model), "--dtype", "float32", "--device", "cpu",
                        "--num-gpu-blocks-override", str(num_blocks), "--max-num-batched-tokens", "64",
                        *extra])


@torch.inference_mode()
def reference_logits(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits for each output position, teacher-forced on the same tokens:
    row i predicts output[i]. If output[i] == argmax(row i) for all i, output is HF's greedy."""
    ids = torch.tensor([prompt + output])
    logits = hf_model(ids).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(output)]


def assert_greedy_equals_reference(runner, ref, prompts: list[list[int]], new_tokens: int) -> None:
    """runner's greedy tokens (through tests/plan_driver.py) are ref's (a transformers model, in
    float64 for the quantized formats), and its logits within 1e-4 of ref's on the same tokens."""
    from tests.plan_driver import PlanDriver
    for prompt, seq in zip(prompts, PlanDriver(runner).generate(prompts, new_tokens)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                min_new_tokens=new_tokens)[0, len(prompt):].tolist()
            logits = ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
        assert seq.output == want
        err = (torch.stack(seq.logits).double() - logits).abs().max().item()
        assert err < 1e-4, err
