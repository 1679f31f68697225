"""Draft-model speculation (worker/speculation/draft_model.py) on tiny random checkpoints, the real scheduler
feeding the real ModelRunner in process: answers are transformers' greedy tokens of the target
whatever the draft; the target as its own draft has every proposal accepted; a noisy copy as the
draft is rejected at times; preemption by recompute and by swap (a row whose draft cache
starts again, caught up in chunks) changes no answer; a seeded sampled request gives the same
tokens alone and in a batch."""
from __future__ import annotations

import json
from collections import deque

import pytest
import torch

from proto import internal_pb2 as pb
from tests.unit.scheduler.test_scheduler import GW, make_router, run, with_workers
from tests.worker_tiny_models import make_hf_model, runner_args, save_model
from process_life.flag_errors import FlagError
from worker.speculation import draft_model
from worker.runner import ModelRunner

K = 3
NEW_TOKENS = 20
PROMPTS = [[3, 17, 99, 4, 250, 8, 61, 61, 7, 1, 200, 13, 42, 42, 5, 90, 11, 0, 6, 77, 31],
           [9, 8, 7, 6, 5], [100, 101, 102, 103, 104, 105, 106, 107, 108]]
NOISE = 0.05      # times each weight's standard deviation, on the draft's copy
MIN_MARGIN = 1e-3  # between the top two logits on the greedy path: no near-tie to round apart


class InProcessWorker:
    """A ModelRunner where tests/unit/scheduler/test_scheduler.py's loop expects a worker."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.inbox = runner, deque()

    def hello(self) -> pb.WorkerHello:
        return self.runner.hello()

    def execute(self, plan: pb.StepPlan) -> pb.StepResult:
        return self.runner.execute(plan)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, and a copy with noise on its weights to serve as a poorer draft."""
    target = make_hf_model("llama", seed=0)
    folder = save_model(target, tmp_path_factory.mktemp("target"))
    noisy, g = make_hf_model("llama", seed=0), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * p.std() * torch.randn(p.shape, generator=g))
    other = save_model(noisy, tmp_path_factory.mktemp("noisy"))
    return target, folder, other


@pytest.fixture(scope="module")
def reference(models):
    """transformers' greedy answer of the target to each prompt."""
    target = models[0]
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                logits = target(torch.tensor([ids])).logits[0, -1]
                top2 = logits.topk(2).values
                assert float(top2[0] - top2[1]) > MIN_MARGIN
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


def preempting(mode: str | None) -> tuple[str, ...]:
    """Flags under which PROMPTS' three sequences (25 to 41 tokens and their proposals) outgrow
    the pool (16 blocks of 4) and are preempted by `mode`."""
    if mode is None:
        return ()
    return ("--block-size", "4", "--num-gpu-blocks-override", "16",
            *(("--swap-space", "0.001") if mode == "swap" else ()))


def serve(target, draft, *flags: str):
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": K})
    runner = ModelRunner(runner_args(target, "--speculative-config", spec, *flags))
    if "--swap-space" in flags:  # the cost model then prefers moving blocks to computing them
        runner.swap_bytes_per_s = 1e15
    router = make_router()
    return router, with_workers(router, InProcessWorker(runner))


def generate(router, workers, prompts, sampling=None, max_tokens=NEW_TOKENS) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        router.add(GW, pb.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=max_tokens,
                                     sampling=sampling or pb.SamplingConfig()))
    out = {}
    run(router, workers, out)
    return [out[(f"r{i}", 0)]["tokens"] for i in range(len(prompts))]


def stats(router):
    return router.workers[b"w0"].scheduler


@pytest.mark.parametrize("preemption", [None, "recompute", "swap"])
def test_the_target_as_its_own_draft_has_every_proposal_accepted(models, reference, monkeypatch,
                                                                  preemption):
    """Any stale KV in the draft's cache (a row back from a preemption, or after a rejection)
    would make it propose other tokens than the target's greedy ones: every proposal is
    accepted only if the draft's cache is exact."""
    _, folder, _ = models
    monkeypatch.setattr(draft_model, "CATCH_UP_TOKENS", 8)  # a prompt's catch-up in chunks
    router, workers = serve(folder, folder, *preempting(preemption))
    assert generate(router, workers, PROMPTS) == reference
    sched = stats(router)
    if preemption:
        assert sched.stats.num_preemptions[preemption] > 0
    assert sched.speculation.num_draft_tokens > NEW_TOKENS
    assert sched.speculation.num_accepted_tokens == sched.speculation.num_draft_tokens
    assert sched.kv.num_free == sched.kv.num_blocks


def test_a_noisy_draft_is_rejected_at_times_and_the_answers_stay_the_targets(models, reference,
                                                                            monkeypatch):
    """Its proposals are those of a draft that computes every row's tokens afresh each time
    (so that no KV of a rejected proposal can stay in its cache): the same acceptance."""
    _, folder, noisy = models
    router, workers = serve(folder, noisy, *preempting("recompute"))
    assert generate(router, workers, PROMPTS) == reference
    spec = stats(router).speculation
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    monkeypatch.setattr(draft_model.DraftModel, "settle",
                        staticmethod(lambda batch, slot, known, accepted:
                                     batch.num_draft_computed.__setitem__(slot, 0)))
    router, workers = serve(folder, noisy, *preempting("recompute"))
    assert generate(router, workers, PROMPTS) == reference
    afresh = stats(router).speculation
    assert (afresh.num_accepted_tokens, afresh.num_draft_tokens, afresh.accepted_per_position) == \
        (spec.num_accepted_tokens, spec.num_draft_tokens, spec.accepted_per_position)


def test_a_smaller_draft_has_a_cache_of_its_own_shape_and_the_answers_stay_the_targets(
        models, reference, tmp_path):
    """One layer of half the width and heads: the draft's cache is sized and addressed by its
    own config, through the target's block tables, preempted and caught up again."""
    from transformers import LlamaConfig, LlamaForCausalLM
    _, folder, _ = models
    small = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None))
    router, workers = serve(folder, save_model(small, tmp_path / "small"), *preempting("recompute"))
    draft = workers[b"w0"].runner.speculator.draft  # the target: 2 layers, 2 KV heads of 16
    assert draft.cache.device_cache.shape[:1] + draft.cache.device_cache.shape[-2:] == (1, 1, 16)
    assert generate(router, workers, PROMPTS) == reference
    sched = stats(router)
    assert sched.stats.num_preemptions["recompute"] > 0
    assert sched.speculation.num_draft_tokens > NEW_TOKENS
    assert sched.kv.num_free == sched.kv.num_blocks


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(models):
    _, folder, other = models
    sampling = pb.SamplingConfig(temperature=0.9, top_p=0.9, has_seed=True, seed=7)
    alone = generate(*serve(folder, other), [PROMPTS[0]], sampling)
    batch = generate(*serve(folder, other), [PROMPTS[0], PROMPTS[1], PROMPTS[0]], sampling)
    assert batch[0] == batch[2] == alone[0]
    assert len(alone[0]) == NEW_TOKENS


def test_a_draft_that_is_missing_or_of_another_vocabulary_stops_the_worker_naming_the_field(
        models, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    _, folder, _ = models
    with pytest.raises(FlagError, match=r"--speculative-config.model '.*absent': no such file") as refused:
        serve(folder, tmp_path / "absent")
    assert refused.value.code == 2  # the launcher stops everything rather than restart it
    small = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    with pytest.raises(FlagError, match=r"--speculative-config.model: .*128 tokens, the target's 256"):
        serve(folder, save_model(small, tmp_path / "small"))
