"""Dense fp32 and bf16 models take worker/model/fused_decode.py's one-C-call decode step: their decode
steps go through kernels/csrc/cpu_decode_layer.c, and what comes out is transformers' (fp32: the same
greedy tokens, logits within 1e-4; bf16: within bf16's rounding of transformers in fp32). A
model the step does not take (--cpu-matmul torch) runs layer by layer (int8 weights:
tests/unit/worker/test_worker_int8.py)."""
from __future__ import annotations

import json

import pytest
import torch

from pagoda.kernels import cpu_decode_layer
from pagoda.kernels.cpu_decode_layer import decode_step
from tests.plan_driver import PlanDriver
from tests.worker_tiny_models import (assert_greedy_equals_reference, make_hf_model, reference_logits,
                                      runner_args, save_model)
from worker.model import fused_decode
from worker.startup import measurements as startup_measurements
from worker.runner import ModelRunner
from worker.worker_flags import DECODE_STEP_TOKENS

PROMPTS = [[5, 6, 7, 8, 9, 10], [200, 3, 17]]
NEW_TOKENS = 12

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(),
                                reason="no decode step kernel on this CPU")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = make_hf_model("llama")
    return hf, save_model(hf, tmp_path_factory.mktemp("llama"))


@pytest.fixture
def fused_steps(monkeypatch):
    """The token count of every step that went through the C step."""
    steps = []
    monkeypatch.setattr(cpu_decode_layer, "decode_step",
                        lambda *a, **k: steps.append(a[3].shape[0]) or decode_step(*a, **k))
    return steps


def test_an_fp32_model_decodes_in_one_c_step_and_equals_transformers(llama, fused_steps):
    hf, folder = llama
    runner = ModelRunner(runner_args(folder))
    fused = runner.model.model.fused_decode
    assert fused is not None and fused.shape.kind == "f32"
    assert fused.weights[0].qkv.data_ptr() == runner.model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()
    assert_greedy_equals_reference(runner, hf, PROMPTS, NEW_TOKENS)
    # Every decode step (two sequences at once, then one) went through it.
    assert len(fused_steps) >= NEW_TOKENS - 1 and set(fused_steps) <= {1, 2}


def test_a_bf16_model_decodes_in_one_c_step_within_bf16s_rounding(llama, fused_steps):
    hf, folder = llama
    runner = ModelRunner(runner_args(folder, "--dtype", "bfloat16"))
    fused = runner.model.model.fused_decode
    assert fused is not None and fused.shape.kind == "bf16"
    assert all(w.norm1.dtype == torch.float32 for w in fused.weights)  # fp32 copies of the norms
    for prompt, seq in zip(PROMPTS, PlanDriver(runner).generate(PROMPTS, NEW_TOKENS)):
        ours, ref = torch.stack(seq.logits), reference_logits(hf, prompt, seq.output)
        # bf16 keeps 8 bits of mantissa: the bound of test_worker_runner.py's bf16 test.
        assert (ours - ref).abs().max() < 0.1 * ref.std()
    assert len(fused_steps) >= NEW_TOKENS - 1


def test_a_model_the_c_step_does_not_take_decodes_layer_by_layer(llama, fused_steps):
    hf, folder = llama
    runner = ModelRunner(runner_args(folder, "--cpu-matmul", "torch"))
    assert runner.model.model.fused_decode is None
    PlanDriver(runner).generate(PROMPTS, 3)
    assert fused_steps == []


def test_more_tokens_than_the_dense_bound_run_layer_by_layer(llama, fused_steps):
    """A step of more decodes than MAX_DENSE_TOKENS: the fp32 kernel's blocks of rows are faster."""
    hf, folder = llama
    runner = ModelRunner(runner_args(folder))
    prompts = [[i + 1, i + 2, i + 3] for i in range(fused_decode.MAX_DENSE_TOKENS + 1)]
    fused_steps.clear()  # start-up's own C steps (the kernel's check against float64)
    PlanDriver(runner).generate(prompts, 3)
    assert fused_steps == []


def test_the_decode_step_bound_is_measured_at_a_machines_first_start_kept_and_obeyed(
        llama, fused_steps, monkeypatch, tmp_path):
    """With a pool to time in, start-up times each count of DECODE_STEP_TOKENS through the C step
    and through the layers (real steps; a stand-in `bound` then picks 2 whatever the timings, so
    that the test does not depend on this machine's), and the bound holds: a step of 2 decodes takes
    the C call, one of 3 the layers, the answers stay transformers'. The next start reads the kept
    bound without timing; --cpu-decode-step-tokens sets it without timing."""
    hf, folder = llama
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    timed = []

    def pick_two(counts, ratio_at):
        timed.extend((n, ratio_at(n)) for n in counts)
        return 2
    monkeypatch.setattr(startup_measurements, "bound", pick_two)
    runner = ModelRunner(runner_args(folder, num_blocks=1024))
    assert [n for n, _ in timed] == list(DECODE_STEP_TOKENS) and all(r > 0 for _, r in timed)
    assert runner.model.model.fused_decode.max_tokens == 2 and fused_decode.enabled
    assert "decode-step.json" in {p.name for p in tmp_path.iterdir()}
    fused_steps.clear()  # the measurement's own C steps
    assert_greedy_equals_reference(runner, hf, PROMPTS, NEW_TOKENS)  # two at once: the C call
    assert fused_steps and set(fused_steps) <= {1, 2}
    fused_steps.clear()
    PlanDriver(runner).generate([[4, 5, 6], [7, 8], [9, 10, 11, 12]], 3)  # three at once: the layers
    assert fused_steps == []

    timed.clear()
    assert ModelRunner(runner_args(folder, num_blocks=1024)).model.model.fused_decode.max_tokens == 2
    assert timed == []
    pinned = ModelRunner(runner_args(folder, "--cpu-decode-step-tokens", "1", num_blocks=1024))
    assert pinned.model.model.fused_decode.max_tokens == 1 and timed == []


def test_a_bf16_models_products_for_few_tokens_are_measured_at_first_start_kept_and_obeyed(
        llama, monkeypatch, tmp_path):
    """Where the CPU has bf16 dot products, start-up times one-token steps with them and with the
    widened weights (back to back), keeps which won, and steps of 1-4 tokens take it; steps from
    BF16_DOT_MIN_TOKENS take the best products here. The next start obeys what was kept."""
    here = cpu_decode_layer.bf16_dot_here()
    if not here:
        pytest.skip("no bf16 dot products on this CPU")
    hf, folder = llama
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    monkeypatch.setattr(cpu_decode_layer, "few_rows_dot", False)
    calls = []  # (tokens, bf16 products) of every C step
    fn = cpu_decode_layer._kernel.fn
    monkeypatch.setattr(cpu_decode_layer._kernel, "fn",
                        lambda layers, n, p: calls.append((p._obj.T, p._obj.bf16_dot)) or fn(layers, n, p))
    runner = ModelRunner(runner_args(folder, "--dtype", "bfloat16", num_blocks=1024))
    assert {(1, 0), (1, 1)} <= set(calls)  # timed both ways
    assert {m for t, m in calls if t >= cpu_decode_layer.BF16_DOT_MIN_TOKENS} == {here}
    kept = json.loads((tmp_path / "decode-step.json").read_text())
    [chosen] = [entry["bf16_few_rows_dot"] for entry in kept.values()]
    assert cpu_decode_layer.few_rows_dot is chosen
    calls.clear()
    for prompt, seq in zip(PROMPTS, PlanDriver(runner).generate(PROMPTS, NEW_TOKENS)):
        ours, ref = torch.stack(seq.logits), reference_logits(hf, prompt, seq.output)
        assert (ours - ref).abs().max() < 0.1 * ref.std()
    assert calls and set(calls) == {(t, int(chosen)) for t, _ in calls}  # 1 and 2 tokens

    for entry in kept.values():
        entry["bf16_few_rows_dot"] = not chosen
    (tmp_path / "decode-step.json").write_text(json.dumps(kept))
    calls.clear()
    ModelRunner(runner_args(folder, "--dtype", "bfloat16", num_blocks=1024))
    assert cpu_decode_layer.few_rows_dot is (not chosen) and (1, int(chosen)) not in calls  # nothing timed

    # --cpu-decode-step-tokens pins the bound, but the products of few tokens are still timed
    # (once: kept apart from the full measurement), and obeyed.
    monkeypatch.setattr(cpu_decode_layer, "few_rows_dot", not chosen)
    calls.clear()
    pinned = ModelRunner(runner_args(folder, "--dtype", "bfloat16", "--cpu-decode-step-tokens", "3",
                                     num_blocks=1024))
    assert pinned.model.model.fused_decode.max_tokens == 3
    assert {(1, 0), (1, 1)} <= set(calls) and {t for t, _ in calls} == {1}  # no bound timed
    assert len(json.loads((tmp_path / "decode-step.json").read_text())) == 2
    assert cpu_decode_layer.few_rows_dot is [e["bf16_few_rows_dot"] for e in json.loads(
        (tmp_path / "decode-step.json").read_text()).values()][-1]
