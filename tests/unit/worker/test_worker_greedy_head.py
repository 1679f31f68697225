"""A bf16 model's plain greedy rows take their tokens from the LM head's own max
(LlamaForCausalLM.greedy_tokens, kernels/csrc/cpu_bf16_greedy.h) instead of logits and the
sampler; the tokens are the sampler's, and any row that needs the logits (a temperature,
logprobs, a penalty, a bias, min_tokens over stop ids) keeps the logits for the whole step."""
from __future__ import annotations

import pytest

from pagoda.kernels import cpu_gemm_bf16
from proto import internal_pb2
from tests.plan_driver import PlanDriver
from tests.worker_tiny_models import make_hf_model, runner_args, save_model
from worker.runner import ModelRunner
from worker.step.sampler import plain_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10], [200, 3, 17], [44] * 20]
NEW_TOKENS = 10

pytestmark = pytest.mark.skipif(not cpu_gemm_bf16.available() or cpu_gemm_bf16._kernel.best < 2,
                                reason="no AVX512-BF16 here: the LM head's greedy max has no path")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = save_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))
    return ModelRunner(runner_args(folder, "--dtype", "bfloat16"))


def driven(runner, monkeypatch, fused: bool = True) -> tuple[PlanDriver, dict[str, int]]:
    """A PlanDriver, and the runner's calls of the model's two ways to a token (the driver's own
    logits, computed beside a fused step, not counted); fused False: the head's max is off."""
    driver = PlanDriver(runner)
    calls = {"greedy_tokens": 0, "compute_logits": 0}
    model = runner.model
    for name in calls:
        inner = getattr(model, name)

        def wrapped(hidden, name=name, inner=inner):
            calls[name] += 1
            return inner(hidden) if fused or name != "greedy_tokens" else None
        monkeypatch.setattr(model, name, wrapped)
    return driver, calls


def test_plain_greedy_rows_take_the_heads_max_and_the_samplers_tokens(runner, monkeypatch):
    with monkeypatch.context() as m:
        driver, off = driven(runner, m, fused=False)
        expected = [s.output for s in driver.generate(PROMPTS, NEW_TOKENS)]
    assert off["compute_logits"] == off["greedy_tokens"] > 0
    driver, calls = driven(runner, monkeypatch)
    got = [s.output for s in driver.generate(PROMPTS, NEW_TOKENS)]
    assert got == expected
    assert calls["compute_logits"] == 0 and calls["greedy_tokens"] >= NEW_TOKENS


@pytest.mark.parametrize("field,value", [
    ("temperature", 0.8), ("logprobs", 2), ("repetition_penalty", 1.3), ("presence_penalty", 0.5),
    ("frequency_penalty", -0.5)])
def test_a_row_that_needs_its_logits_keeps_them(runner, monkeypatch, field, value):
    sampling = internal_pb2.SamplingConfig(**{field: value})
    assert not plain_greedy(sampling)
    driver, calls = driven(runner, monkeypatch)
    driver.generate(PROMPTS[:1], 3, sampling)
    assert calls["greedy_tokens"] == 0 and calls["compute_logits"] == 3


def test_which_rows_are_plain_greedy():
    assert plain_greedy(internal_pb2.SamplingConfig())
    assert plain_greedy(internal_pb2.SamplingConfig(repetition_penalty=1.0, min_tokens=4))  # no stop ids to mask
    assert plain_greedy(internal_pb2.SamplingConfig(top_k=5, top_p=0.5, min_p=0.3))  # no effect on a max
    assert not plain_greedy(internal_pb2.SamplingConfig(min_tokens=4, stop_token_ids=[2]))
    assert not plain_greedy(internal_pb2.SamplingConfig(logit_bias={3: 1.0}))
    assert not plain_greedy(internal_pb2.SamplingConfig(logprobs=0))
    assert not plain_greedy(internal_pb2.SamplingConfig(beam_candidates=2))
