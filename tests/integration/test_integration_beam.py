"""Beam search with the real model in fp32: the answers equal transformers' generate(num_beams=k,
num_return_sequences=k, do_sample=False, ...) token for token and in order, over the real stack;
and a width-4 search over a 256-token prompt holds far fewer KV blocks than four independent
sequences (the real worker, driven in-process by the real router, whose KV blocks in use are
read after each plan)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from proto import internal_pb2, pagoda_pb2 as pb
from scheduler.router import Router, RouterConfig
from tests.plan_driver import run_router
from tests.unit.worker.test_model_parity import SMOLLM2_PROMPTS as PARITY_PROMPTS
from tests.worker_tiny_models import runner_args
from worker.runner import ModelRunner

pytestmark = pytest.mark.integration

EOS = 2  # <|im_end|>
NEW_TOKENS = 16
EARLY = {"true": True, "false": False, "never": "never"}
# "The capital of France is", "def fibonacci(n):", "The three primary colors are": chosen because
# no two of their returned beams are near a tie (asserted below) in any case; the chat prompt of
# test_model_parity is, at width 4. Two are streamed, one asked unary. Three, not more:
# transformers' beam search takes about 4 s a prompt here, most of each case's time.
PROMPTS = [PARITY_PROMPTS[0], PARITY_PROMPTS[1], [504, 1296, 3003, 4683, 359]]
# (beam_width, length_penalty, early_stopping); width 2 with 1.0 and "false" is
# tests/integration/test_integration_offline.py's LLM.beam_search case.
CASES = [(4, 1.0, "false"), (4, 2.0, "never"), (2, 0.5, "true")]


@torch.inference_mode()
def hf_beams(model, ids: list[int], width: int, lp: float, early: str) -> list[tuple[list[int], float]]:
    """(output tokens up to and including EOS, cumulative logprob) of each returned beam."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, num_beams=width, num_return_sequences=width,
                         do_sample=False, length_penalty=lp, early_stopping=EARLY[early],
                         eos_token_id=[EOS], pad_token_id=EOS, output_scores=True,
                         return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences[:, len(ids):].tolist(), out.sequences_scores.tolist()):
        tokens = seq[:seq.index(EOS) + 1] if EOS in seq else seq
        beams.append((tokens, score * len(tokens) ** lp))
    # Adjacent beams apart by 0.02 in summed logprob, ten times what the two implementations'
    # logits may differ by over 16 tokens (test_model_parity: 2e-3 per logit, often far less).
    scores = out.sequences_scores.tolist()
    assert all((a - b) * NEW_TOKENS ** lp > 0.02 for a, b in zip(scores, scores[1:])), scores
    return beams


def request(ids: list[int], width: int, lp: float, early: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=ids, stopping=pb.StoppingCriteria(max_tokens=NEW_TOKENS),
        beam_search=pb.BeamSearchParams(beam_width=width, length_penalty=lp, early_stopping=early))


@pytest.mark.parametrize("width,lp,early", CASES)
def test_beam_search_equals_transformers(stub, smollm2_hf, width, lp, early):
    def stream(ids):
        return list(stub.GenerateStream(request(ids, width, lp, early), timeout=600))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(stream, PROMPTS[:2]))
    unary = stub.Generate(request(PROMPTS[2], width, lp, early), timeout=600)
    answers = [[(list(r.token_ids), r.cumulative_logprob, r.finish_reason, r.index) for r in s]
               for s in streams]
    answers.append([(list(c.token_ids), c.cumulative_logprob, c.finish_reason, c.index)
                    for c in unary.completions])
    assert list(unary.token_ids) == list(unary.completions[0].token_ids)  # the best, on top
    for ids, got in zip(PROMPTS, answers):
        expected = hf_beams(smollm2_hf, ids, width, lp, early)
        assert [g[3] for g in got] == list(range(width))  # one final message per beam, best first
        assert [g[0] for g in got] == [tokens for tokens, _ in expected]
        for (_, logprob, finish, _), (tokens, hf_logprob) in zip(got, expected):
            assert logprob == pytest.approx(hf_logprob, abs=0.05)
            assert finish == (pb.FINISH_REASON_STOP if tokens[-1] == EOS else pb.FINISH_REASON_LENGTH)


def peak_blocks(runner: ModelRunner, add_requests) -> int:
    """Drives the real router and the real worker in-process; the most KV blocks in use after
    any plan was made (blocks are taken when a plan is made, and freed when a result comes)."""
    router = Router(RouterConfig(enable_prefix_caching=False))
    router.register(b"w", runner.hello())
    runner.forget_all()
    add_requests(router)
    peak = run_router(router, runner, b"w")
    kv = router.workers[b"w"].scheduler.kv
    assert not router.seqs and kv.num_free == kv.num_blocks
    return peak


def test_beam_width_4_holds_at_most_65_percent_of_independent_blocks():
    runner = ModelRunner(runner_args("", "--max-num-batched-tokens", "1024", num_blocks=256))
    prompt = [random.Random(0).randrange(100, 20000) for _ in range(256)]
    max_tokens = 16

    def beams(router):
        router.add(b"gw", internal_pb2.AddRequest(
            request_id="beam", prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
            sampling=internal_pb2.SamplingConfig(),
            beam_search=pb.BeamSearchParams(beam_width=4, length_penalty=1.0, early_stopping="never")))

    def independent(router):
        for i in range(4):
            router.add(b"gw", internal_pb2.AddRequest(
                request_id=f"seq{i}", prompt_token_ids=prompt, max_tokens=max_tokens,
                ignore_eos=True, sampling=internal_pb2.SamplingConfig()))

    beam_peak, independent_peak = peak_blocks(runner, beams), peak_blocks(runner, independent)
    print(f"\nKV blocks at peak, 256-token prompt + {max_tokens} tokens: beam_width 4 "
          f"{beam_peak}, four independent sequences {independent_peak} "
          f"({beam_peak / independent_peak:.0%})")
    assert independent_peak == 4 * -(-(256 + max_tokens) // 16)
    assert beam_peak <= 0.65 * independent_peak
