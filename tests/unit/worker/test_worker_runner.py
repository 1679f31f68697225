"""ModelRunner against transformers on tiny random checkpoints, through hand-built StepPlans."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.plan_driver import PlanDriver
from proto import internal_pb2
from proto.columns import pack, unpack_f32, unpack_list
from worker.model.config import ModelConfig
from worker.runner import ModelRunner
from tests.worker_tiny_models import VARIANTS, make_hf_model, reference_logits, runner_args, save_model

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[3, 17, 99, 4, 250, 8, 61, 61, 7, 1, 200, 13, 42, 42, 5, 90, 11, 0, 6, 77, 31], [9, 8, 7, 6, 5]]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    model = make_hf_model(request.param)
    folder = save_model(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, folder


@pytest.fixture
def runner(checkpoint):
    return ModelRunner(runner_args(checkpoint[2]))


def assert_matches_reference(hf_model, prompt, seq, atol=1e-4):
    ref = reference_logits(hf_model, prompt, seq.output)
    ours = torch.stack(seq.logits)
    assert seq.output == ref.argmax(-1).tolist()
    torch.testing.assert_close(ours, ref, atol=atol, rtol=1e-4)


def test_config_from_saved_checkpoint(checkpoint):
    variant, model, folder = checkpoint
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.attention_bias == (variant != "llama")
    assert config.o_proj_bias == (variant == "llama3-tied-bias")
    assert config.tie_word_embeddings == (variant == "llama3-tied-bias")
    assert (config.rope_scaling or {}).get("rope_type") == ("llama3" if "llama3" in variant else None)
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_chunked_prefill_batch_and_permuted_blocks_match_transformers(checkpoint, runner):
    _, hf_model, _ = checkpoint
    # Blocks handed out in a scrambled order; 8 tokens per step so the long prompt is prefilled
    # over three steps while the short one joins the batch.
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    seqs = PlanDriver(runner, block_order=order, token_budget=8).generate(PROMPTS, 12)
    for prompt, seq in zip(PROMPTS, seqs):
        assert_matches_reference(hf_model, prompt, seq)


A, B = 3, 8  # slots: any small integers the scheduler picks


def test_hand_built_plans_with_prefix_hit(checkpoint, runner):
    """Sequence b reuses a's first full block (a prefix hit: num_computed_tokens=16)."""
    _, hf_model, _ = checkpoint
    a = PROMPTS[0]                         # 21 tokens
    b = a[:16] + [100, 101, 102]           # shares block 40 with a
    greedy = internal_pb2.SamplingConfig()
    plans = [
        internal_pb2.StepPlan(step_id=0, new_seqs=[internal_pb2.NewSeq(
            seq_id="a", slot=A, token_ids=a, sampling=greedy, block_ids=[40], num_new_tokens=10)]),
        internal_pb2.StepPlan(step_id=1, running_slots=pack([A]), running_num_tokens=pack([11]),
                              new_block_slots=pack([A]), new_block_ids=pack([3])),
        internal_pb2.StepPlan(step_id=2, new_seqs=[internal_pb2.NewSeq(
            seq_id="b", slot=B, token_ids=b, sampling=greedy, num_computed_tokens=16,
            block_ids=[40, 17], num_new_tokens=3)],
            running_slots=pack([A]), running_num_tokens=pack([1])),
        internal_pb2.StepPlan(step_id=3, running_slots=pack([A, B]), running_num_tokens=pack([1, 1])),
    ]
    results = [runner.execute(p) for p in plans]
    assert [r.error for r in results] == [""] * 4
    assert unpack_list(results[0].slots) == []     # a's prefill is not finished: no sample
    assert unpack_list(results[2].slots) == [B, A]  # plan order: new_seqs, then running
    tokens = [unpack_list(r.token_ids) for r in results]
    a_out = [tokens[1][0], tokens[2][1], tokens[3][0]]
    b_out = [tokens[2][0], tokens[3][1]]
    assert a_out == reference_logits(hf_model, a, a_out).argmax(-1).tolist()
    assert b_out == reference_logits(hf_model, b, b_out).argmax(-1).tolist()
    assert runner.batch.tokens(A).tolist() == a + a_out  # the worker appends sampled tokens itself
    assert runner.batch.num_computed[A] == 23


def run_with_recompute(runner, prompt, sampling, first, total):
    """Generate `first` tokens, drop the sequence (preemption by recompute), resend it as a NewSeq
    with prompt + output, and generate up to `total`."""
    driver = PlanDriver(runner)
    out = driver.generate([prompt], first, sampling)[0].output
    runner.execute(internal_pb2.StepPlan(step_id=99, dropped_slots=[0]))
    assert not runner.batch.held[0] and 0 not in runner.batch.sampling
    driver = PlanDriver(runner, block_order=list(range(63, -1, -1)))
    rest = driver.generate([prompt + out], total - first, sampling)
    return out + rest[0].output


SEEDED = internal_pb2.SamplingConfig(temperature=1.0, top_p=0.9, has_seed=True, seed=5)


@pytest.mark.parametrize("sampling", [internal_pb2.SamplingConfig(), SEEDED], ids=["greedy", "seeded"])
def test_recompute_after_preemption_gives_the_same_tokens(checkpoint, runner, sampling):
    straight = PlanDriver(runner).generate([PROMPTS[1]], 10, sampling)[0].output
    runner.execute(internal_pb2.StepPlan(dropped_slots=[0]))
    assert run_with_recompute(runner, PROMPTS[1], sampling, 4, 10) == straight


def test_swap_out_swap_in_and_copy_are_exact(checkpoint):
    runner = ModelRunner(runner_args(checkpoint[2], "--swap-space", "0.001"))
    cache = runner.cache
    assert cache.num_cpu_blocks >= 4
    noise = torch.randn(cache.device_cache.shape, generator=torch.Generator().manual_seed(1))
    cache.device_cache.copy_(noise)
    before = cache.device_cache.clone()
    res = runner.execute(internal_pb2.StepPlan(swap_out=[internal_pb2.BlockCopy(src=5, dst=0),
                                                         internal_pb2.BlockCopy(src=2, dst=3)]))
    assert not res.error
    cache.device_cache[:, :, [2, 5]] = 0
    res = runner.execute(internal_pb2.StepPlan(swap_in=[internal_pb2.BlockCopy(src=0, dst=9),
                                                        internal_pb2.BlockCopy(src=3, dst=11)],
                                               copy=[internal_pb2.BlockCopy(src=20, dst=21)]))
    assert not res.error
    assert torch.equal(cache.device_cache[:, :, 9], before[:, :, 5])
    assert torch.equal(cache.device_cache[:, :, 11], before[:, :, 2])
    assert torch.equal(cache.device_cache[:, :, 21], before[:, :, 20])
    assert torch.equal(cache.device_cache[:, :, 20], before[:, :, 20])
    assert runner.hello().num_cpu_blocks == cache.num_cpu_blocks and runner.hello().swap_bytes_per_s > 0


def test_preemption_by_swap_continues_the_same_tokens(checkpoint):
    runner = ModelRunner(runner_args(checkpoint[2], "--swap-space", "0.001"))
    prompt = PROMPTS[0]
    straight = PlanDriver(runner).generate([prompt], 6)[0].output
    runner.execute(internal_pb2.StepPlan(dropped_slots=[0]))

    driver = PlanDriver(runner, block_order=[4, 7, 60])
    first = driver.generate([prompt], 3)[0].output           # 24 tokens, 23 computed, blocks 4, 7
    swap = [internal_pb2.BlockCopy(src=4, dst=0), internal_pb2.BlockCopy(src=7, dst=1)]
    assert not runner.execute(internal_pb2.StepPlan(swap_out=swap, dropped_slots=[0])).error
    runner.cache.device_cache[:, :, [4, 7]] = float("nan")   # the blocks get reused by others
    tokens = prompt + first
    plan = internal_pb2.StepPlan(
        swap_in=[internal_pb2.BlockCopy(src=0, dst=30), internal_pb2.BlockCopy(src=1, dst=31)],
        new_seqs=[internal_pb2.NewSeq(seq_id="s0", slot=0, token_ids=tokens, block_ids=[30, 31],
                                      num_computed_tokens=len(tokens) - 1, num_new_tokens=1)])
    res = runner.execute(plan)
    assert not res.error and unpack_list(res.slots) == [0]
    out = first + unpack_list(res.token_ids)
    for _ in range(2):
        res = runner.execute(internal_pb2.StepPlan(running_slots=pack([0]), running_num_tokens=pack([1])))
        out += unpack_list(res.token_ids)
    assert out == straight


def test_bad_plans_return_an_error_and_the_runner_survives(checkpoint, runner):
    res = runner.execute(internal_pb2.StepPlan(step_id=7, running_slots=pack([77]), running_num_tokens=pack([1])))
    assert res.step_id == 7 and "77" in res.error and not res.slots
    res = runner.execute(internal_pb2.StepPlan(new_seqs=[internal_pb2.NewSeq(
        seq_id="x", token_ids=list(range(40)), block_ids=[1], num_new_tokens=40)]))
    assert "blocks" in res.error
    res = runner.execute(internal_pb2.StepPlan(swap_out=[internal_pb2.BlockCopy(src=1, dst=0)]))
    assert "swap" in res.error
    assert PlanDriver(runner).generate([PROMPTS[1]], 2)[0].output  # still serves


def test_hello_describes_the_worker(checkpoint, runner):
    hello = runner.hello()
    assert (hello.num_blocks, hello.block_size, hello.max_model_len, hello.vocab_size) == (64, 16, 256, 256)
    assert hello.device == "cpu" and hello.num_cpu_blocks == 0
    assert hello.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4   # layers * (K,V) * block * kv heads * dim * fp32
    assert hello.prefill_tokens_per_s > 0 and hello.worker_id


def test_a_max_model_len_past_the_trained_positions_is_refused_unless_allowed(checkpoint):
    """A worker started on its own (compose, Kubernetes) refuses as the launcher does: exit 2 and
    one line, not answers that degrade silently. Allowed, it serves the longer context."""
    from process_life.flag_errors import FlagError
    folder = checkpoint[2]
    assert ModelConfig.read(folder).max_position_embeddings == 256
    with pytest.raises(FlagError) as refused:
        ModelRunner(runner_args(folder, "--max-model-len", "257"))
    assert (refused.value.code, str(refused.value)) == (
        2, "--max-model-len 257 is beyond the 256 positions the model was trained on "
           "(max_position_embeddings); --allow-long-max-model-len serves it anyway, with answers "
           "that degrade past them")
    allowed = ModelRunner(runner_args(folder, "--max-model-len", "300", "--allow-long-max-model-len"))
    assert allowed.hello().max_model_len == 300
    assert ModelRunner(runner_args(folder, "--max-model-len", "256")).hello().max_model_len == 256


def test_bfloat16_runs_close_to_float32(checkpoint):
    _, hf_model, folder = checkpoint
    args = runner_args(folder)
    args.dtype = "bfloat16"
    runner = ModelRunner(args)
    assert runner.cache.device_cache.dtype == torch.bfloat16
    seq = PlanDriver(runner).generate([PROMPTS[0]], 4)[0]
    ours, ref = torch.stack(seq.logits), reference_logits(hf_model, PROMPTS[0], seq.output)
    assert ours.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: a loose bound relative to the spread of the logits
    # (measured: about 3% of it).
    assert (ours - ref).abs().max() < 0.1 * ref.std()


TRITON_CHECK = """
import sys, torch
from tests.plan_driver import PlanDriver
from tests.unit.worker.test_worker_runner import PROMPTS
from tests.worker_tiny_models import make_hf_model, reference_logits, runner_args, save_model
from worker.runner import ModelRunner
model = make_hf_model("qwen2")
runner = ModelRunner(runner_args(save_model(model, sys.argv[1]), "--attention-backend", "triton"))
assert runner.backend.name == "triton"
order = list(range(63, -1, -1))
for prompt, seq in zip(PROMPTS, PlanDriver(runner, order, token_budget=8).generate(PROMPTS, 3)):
    ref = reference_logits(model, prompt, seq.output)
    assert seq.output == ref.argmax(-1).tolist()
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=1e-4, rtol=1e-4)
print("triton ok")
"""


def test_triton_backend_under_the_interpreter(tmp_path):
    """The Triton kernels (host-side hints included) on CPU tensors, in a process of its own
    because TRITON_INTERPRET must be set before the kernels are imported."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "triton ok" in proc.stdout, proc.stdout + proc.stderr


def test_beam_candidates_come_back_and_the_plan_names_the_next_token(checkpoint, runner):
    """A beam's row returns its top k candidates and keeps only what the plan appends: the
    scheduler's choice (here the third-best candidate), whose next logits are transformers'."""
    _, hf_model, _ = checkpoint
    prompt, k = PROMPTS[1], 4
    beam = internal_pb2.SamplingConfig(beam_candidates=k)
    first = runner.execute(internal_pb2.StepPlan(step_id=0, new_seqs=[internal_pb2.NewSeq(
        seq_id="beam", slot=A, token_ids=prompt, sampling=beam, block_ids=[5],
        num_new_tokens=len(prompt))]))
    [lp] = first.logprobs
    ref = reference_logits(hf_model, prompt, [0])[0].log_softmax(-1)
    top = ref.topk(k)
    assert (lp.slot, lp.k, unpack_list(lp.top_token_ids)) == (A, k, top.indices.tolist())
    torch.testing.assert_close(torch.tensor(unpack_f32(lp.top_logprobs)), top.values, atol=1e-4, rtol=0)
    assert runner.batch.tokens(A).tolist() == prompt  # its own sample is not appended
    chosen = unpack_list(lp.top_token_ids)[2]
    second = runner.execute(internal_pb2.StepPlan(
        step_id=1, next_token_slots=pack([A]), next_token_ids=pack([chosen]),
        running_slots=pack([A]), running_num_tokens=pack([1])))
    assert runner.batch.tokens(A).tolist() == prompt + [chosen]
    ref = reference_logits(hf_model, prompt + [chosen], [0])[0].log_softmax(-1)
    assert unpack_list(second.logprobs[0].top_token_ids) == ref.topk(k).indices.tolist()
    bad = runner.execute(internal_pb2.StepPlan(step_id=2, next_token_slots=pack([A, A]),
                                               next_token_ids=pack([1, 2])))
    assert bad.error == "bad plan: next_token_slots names a slot twice"
