"""The worker's model against transformers' generate(do_sample=False), token for token, with the
real SmolLM2 GGUF (integration) and with a tiny random Qwen2 (q/k/v bias). Prompts are batched
into one prefill step, then every step decodes one token per sequence, as the scheduler does."""
from __future__ import annotations

import pytest
import torch

from tests.plan_driver import PlanDriver
from tests.worker_tiny_models import make_hf_model, runner_args, save_model
from worker.runner import ModelRunner

NEW_TOKENS = 64
EOS = 2  # <|im_end|>

# SmolLM2's tokenizer on: "The capital of France is", "def fibonacci(n):", a chat-templated
# "Write a short poem about the sea.", and "Once upon a time, in a small village,". Ids, not text,
# so the test does not spend seconds converting the GGUF tokenizer.
SMOLLM2_PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [1, 4093, 198, 19161, 253, 1890, 8216, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
]
TINY_PROMPTS = [[5, 6, 7], [200, 13, 42, 42, 5, 90, 11, 0, 6, 77, 31, 3, 17, 99, 4, 250, 8, 61, 1],
                [9], [128, 64, 32, 16, 8, 4, 2, 1]]


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """One batched generate, prompts left-padded (masked, positions from the mask): the tokens
    [B, NEW_TOKENS] and the raw logits [B, NEW_TOKENS, V]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[:, width:].tolist(), torch.stack(out.logits, dim=1).float()


def assert_parity(hf_model, runner, prompts, atol):
    seqs = PlanDriver(runner).generate(prompts, NEW_TOKENS)
    ref_tokens, ref_logits = hf_greedy(hf_model, prompts)
    for seq, tokens, logits in zip(seqs, ref_tokens, ref_logits):
        # Up to and including the reference's first EOS; generate may run on past it.
        n = tokens.index(EOS) + 1 if EOS in tokens else len(tokens)
        assert n >= 8
        assert seq.output[:n] == tokens[:n]
        torch.testing.assert_close(torch.stack(seq.logits)[:n], logits[:n], atol=atol, rtol=0)


@pytest.mark.integration
def test_smollm2_greedy_matches_transformers(smollm2_hf):
    runner = ModelRunner(runner_args("", num_blocks=64))
    assert runner.config.num_layers == 30 and runner.config.tie_word_embeddings
    assert_parity(smollm2_hf, runner, SMOLLM2_PROMPTS, atol=2e-3)


def test_tiny_qwen2_greedy_matches_transformers(tmp_path):
    model = make_hf_model("qwen2", seed=1)
    runner = ModelRunner(runner_args(save_model(model, tmp_path)))
    assert runner.config.attention_bias
    assert_parity(model, runner, TINY_PROMPTS, atol=1e-4)
