"""worker.model.loader on a tiny GGUF written here the way llama.cpp's converter writes one (q/k rows
permuted for its rope, some tensors Q8_0): the same tensors as transformers' own GGUF loader,
cached as safetensors on first load, and the same greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.plan_driver import PlanDriver
from tests.worker_tiny_models import make_hf_model, reference_logits, runner_args
from worker.model.loader import CACHE_FILE, CACHE_NAME, load_weights
from worker.runner import ModelRunner

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_gguf(model, path, qtypes=None):
    """qtypes: the format of the 2-D tensors whose HF name holds a key (default: the MLP's Q8_0)."""
    import gguf

    qtypes = qtypes or {".mlp.": gguf.GGMLQuantizationType.Q8_0}
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for name, t in model.state_dict().items():
        arr = t.numpy().astype(np.float32)
        if ".q_proj." in name:
            arr = llama_cpp_permute(arr, c.num_attention_heads)
        elif ".k_proj." in name:
            arr = llama_cpp_permute(arr, c.num_key_value_heads)
        qtype = next((t for key, t in qtypes.items() if key in name), None) if arr.ndim == 2 else None
        if qtype is not None:  # exercise dequantization on part of the model
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = write_gguf(make_hf_model("llama"), tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return path, hf


def test_gguf_weights_equal_transformers_and_are_cached(tiny_gguf, tmp_path, monkeypatch):
    path, hf = tiny_gguf
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    config, weights = load_weights(path)
    assert (config.architecture, config.num_kv_heads) == ("llama", 2)
    assert (config.eos_token_ids, config.bos_token_id) == ([2], 1)
    assert not config.tie_word_embeddings
    reference = hf.state_dict()
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    cached = list(tmp_path.glob(f"*/{CACHE_NAME}/{CACHE_FILE}"))
    assert len(cached) == 1 and (cached[0].parent / "config.json").exists()
    # The second load comes from the cache: same tensors without touching the GGUF.
    monkeypatch.setattr("worker.model.loader.load_gguf", lambda p: pytest.fail("dequantized again"))
    config2, weights2 = load_weights(path)
    assert config2 == config and all(torch.equal(weights2[k], v) for k, v in weights.items())


def test_runner_on_gguf_matches_transformers(tiny_gguf, tmp_path, monkeypatch):
    path, hf = tiny_gguf
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    runner = ModelRunner(runner_args(path))
    prompts = [[1, 30, 31, 32, 200, 7, 7, 9, 100, 45, 3, 3, 3, 250, 11, 12, 13, 14], [1, 2, 3]]
    for prompt, seq in zip(prompts, PlanDriver(runner).generate(prompts, 8)):
        ref = reference_logits(hf, prompt, seq.output)
        assert seq.output == ref.argmax(-1).tolist()
        torch.testing.assert_close(torch.stack(seq.logits), ref, atol=1e-4, rtol=1e-4)


def test_a_cache_that_cannot_be_written_costs_only_the_next_start(tmp_path, caplog):
    """A full or vanished disk under the cache: safetensors says so with its own error, not
    OSError; the worker warns and starts, and no half-written file is left behind."""
    from worker.model.loader import _save_tensors, _write_by_rename

    gone = tmp_path / "gone" / "blocks.safetensors"
    assert _write_by_rename(gone, lambda tmp: _save_tensors({"w": torch.ones(2)}, tmp)) is False
    assert "could not cache blocks.safetensors" in caplog.text
    here = tmp_path / "blocks.safetensors"
    assert _write_by_rename(here, lambda tmp: _save_tensors({"w": torch.ones(2)}, tmp)) is True
    assert [p.name for p in tmp_path.iterdir()] == ["blocks.safetensors"]

