"""--quantization q8_0 / q4_1: GGUF's blocks of 32 weights. The reference is transformers' model in
float64 with the same dequantized weights (the file's own blocks where it stores that format,
else gguf's reference quantizer on the float weights; a tied vocabulary projection quantized
apart from the embedding, whose lookup keeps its float rows): greedy output equal to it and
logits within a bound, on tiny checkpoints (bench/quantized_accuracy.py runs the real model)."""
from __future__ import annotations

import copy

import pytest
import torch

from process_life.flag_errors import FlagError
from pagoda.kernels import cpu_decode_layer, cpu_gemm_gguf
from pagoda.kernels.cpu_decode_layer import decode_step
from tests.unit.worker.test_worker_loader import write_gguf
from tests.worker_tiny_models import assert_greedy_equals_reference, make_hf_model, runner_args, save_model
from worker.model.loader import gguf_blocks
from worker.runner import ModelRunner

PROMPTS = [[5, 6, 7, 8, 9, 10], [200, 3, 17]]
NEW_TOKENS = 16


def dequantized_float64(hf, kind: str, stored: dict[str, torch.Tensor] | None = None):
    """hf with every projection's weights replaced by their kind blocks dequantized in float64:
    stored[HF name] (worker/model/loader.py gguf_blocks) where given, else quantized here."""
    stored = stored or {}
    ref = copy.deepcopy(hf).double()
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                tied = name == "lm_head" and ref.config.tie_word_embeddings
                key = "model.embed_tokens.weight" if tied else f"{name}.weight"
                blocks = stored.get(key)
                if blocks is None:
                    source = ref.model.embed_tokens.weight if tied else module.weight
                    blocks = cpu_gemm_gguf.quantize(source.float(), kind)
                w = cpu_gemm_gguf.dequantize(blocks, kind, torch.float64)
                module.weight = torch.nn.Parameter(w)  # the head untied: the embedding stays float
    return ref


def assert_equals_reference(runner, ref, prompts=PROMPTS):
    assert_greedy_equals_reference(runner, ref, prompts, NEW_TOKENS)


@pytest.fixture
def exact_activations(monkeypatch):
    """The kernel's fp32-activation paths (the default): the model equals float64 within 1e-4."""
    monkeypatch.setattr(cpu_gemm_gguf, "int8_activations", False)


# Each kind once (the tied head with biases for one), within the time a unit test may take; the
# GGUF test below runs q4_1 on a llama too, and test_worker_int8.py every variant.
@pytest.mark.parametrize("variant,kind", [("llama", "q8_0"), ("llama3-tied-bias", "q4_1")])
def test_greedy_and_logits_equal_float64_on_the_dequantized_weights(variant, kind, tmp_path, exact_activations,
                                                                     monkeypatch):
    hf = make_hf_model(variant)
    runner = ModelRunner(runner_args(save_model(hf, tmp_path / variant), "--quantization", kind))
    linears = [m for m in runner.model.modules() if getattr(m, "blocks", None) is not None]
    assert linears and all(m.weight is None and m.kind == kind for m in linears)
    assert runner.model.lm_head_gguf is not None
    # Decode steps run as one C step (worker/model/fused_decode.py) where the model qualifies: not with
    # biases, which the other variant has, so both ways are held to the reference.
    fused = variant == "llama" and cpu_decode_layer.available()
    assert (runner.model.model.fused_decode is not None) == fused
    steps = []
    monkeypatch.setattr(cpu_decode_layer, "decode_step",
                        lambda *a, **k: steps.append(a[3].shape[0]) or decode_step(*a, **k))
    assert_equals_reference(runner, dequantized_float64(hf, kind))
    assert (len(steps) >= NEW_TOKENS - 1) == fused and all(t == len(PROMPTS) for t in steps)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_int8_activations_keep_the_logits_near(kind, tmp_path, monkeypatch):
    """With int8_activations, where the CPU has the int8 paths (llama.cpp's way): x rounded to 8 bits per
    block of 32 costs some logit error. On the runner's own tokens, its logits stay within 0.1
    of float64's; a tiny random model's near-ties may flip a greedy token, so the greedy check is
    the real model's (bench/quantized_accuracy.py: at least 7 of 8 prompts)."""
    from tests.plan_driver import PlanDriver
    monkeypatch.setattr(cpu_gemm_gguf, "int8_activations", True)
    if cpu_gemm_gguf.best_isa() not in cpu_gemm_gguf.INT8_ISAS:
        pytest.skip("this CPU has no int8 path")
    hf = make_hf_model("llama")
    runner = ModelRunner(runner_args(save_model(hf, tmp_path / "m"), "--quantization", kind))
    ref = dequantized_float64(hf, kind)
    for prompt, seq in zip(PROMPTS, PlanDriver(runner).generate(PROMPTS, NEW_TOKENS)):
        with torch.no_grad():
            want = ref(torch.tensor([prompt + seq.output])).logits[0, len(prompt) - 1:-1]
        err = (torch.stack(seq.logits).double() - want).abs().max().item()
        assert 1e-4 < err < 0.1, err  # rounded x (not the exact path), and near float64


def test_a_gguf_files_own_blocks_are_used_as_they_are(tmp_path, monkeypatch, exact_activations):
    """Attention stored Q4_1 and the MLP Q8_0 (q/k rows permuted as llama.cpp writes them): with
    q4_1 the attention's blocks are the file's, byte for byte; the rest is quantized here."""
    import gguf
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(make_hf_model("llama"), tmp_path / "tiny.gguf",
                      {".self_attn.": Q4_1, ".mlp.": Q8_0})
    stored = gguf_blocks(path, "q4_1")
    assert len(stored) == 8 and all(".self_attn." in name for name in stored)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for name, blocks in stored.items():  # in HF's row order (q/k unpermuted), as its floats
        torch.testing.assert_close(cpu_gemm_gguf.dequantize(blocks, "q4_1", torch.float64),
                                   hf.state_dict()[name].double(), atol=1e-6, rtol=0)
    quantized = []
    quantize = cpu_gemm_gguf.quantize
    # The fused step's start-up check and the GGUF kernel's bound measurements (kept, then read
    # back by the next runner) quantize random weights of their own: a first runner pays them
    # before the spy.
    ModelRunner(runner_args(path, "--quantization", "q4_1"))
    with monkeypatch.context() as spy:
        spy.setattr(cpu_gemm_gguf, "quantize", lambda w, kind: quantized.append(tuple(w.shape)) or quantize(w, kind))
        runner = ModelRunner(runner_args(path, "--quantization", "q4_1"))
    # Per layer: gate, up and down, then the vocabulary projection: nothing of the attention.
    assert quantized == [(96, 64), (96, 64), (64, 96)] * 2 + [(256, 64)]
    attn = runner.model.model.layers[1].self_attn
    v_rows = attn.qkv_proj.blocks[-attn.kv_size:]
    assert torch.equal(v_rows, stored["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(attn.o_proj.blocks, stored["model.layers.1.self_attn.o_proj.weight"])
    assert_equals_reference(runner, dequantized_float64(hf, "q4_1", stored), PROMPTS[:1])


def test_a_gguf_files_blocks_are_read_once_then_from_the_cache(tmp_path, monkeypatch):
    """The second start reads the blocks from the cache, equal byte for byte, without parsing the
    GGUF (its metadata takes seconds on a real vocabulary); a file with no tensors of the format
    caches that too; a rewritten file is read again."""
    import gguf
    import os

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    Q4_1 = gguf.GGMLQuantizationType.Q4_1
    path = write_gguf(make_hf_model("llama"), tmp_path / "tiny.gguf", {".self_attn.": Q4_1})
    first, none = gguf_blocks(path, "q4_1"), gguf_blocks(path, "q8_0")
    assert len(first) == 8 and none == {}
    with monkeypatch.context() as spy:
        spy.setattr(gguf, "GGUFReader", lambda *a: pytest.fail("the GGUF was parsed again"))
        again, none_again = gguf_blocks(path, "q4_1"), gguf_blocks(path, "q8_0")
    assert set(again) == set(first) and all(torch.equal(again[k], v) for k, v in first.items())
    assert none_again == {}
    write_gguf(make_hf_model("llama"), path, {".mlp.": Q4_1})
    os.utime(path, ns=(1, 1))  # another mtime, whatever the clock's resolution
    rewritten = gguf_blocks(path, "q4_1")
    assert len(rewritten) == 6 and all(".mlp." in name for name in rewritten)


def test_refused_where_it_cannot_run(tmp_path):
    hf = make_hf_model("llama")
    with pytest.raises(FlagError, match="--quantization q4_1 runs on the CPU, with --dtype float32"):
        ModelRunner(runner_args(save_model(hf, tmp_path / "m"), "--quantization", "q4_1",
                                "--dtype", "bfloat16"))
