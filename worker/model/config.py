"""The shape of a Llama-family model, read from a HF config.json or from GGUF metadata.

One flat dataclass so that the model code never has to know which file format it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.model.eos import end_of_turn_ids, gguf_special_tokens

# The folder of a GGUF's converted weights and config.json (modelfiles.resolve.cache_dir); bumped
# when the conversion changes what it writes (v2: end-of-turn ids in config.json).
WEIGHTS_CACHE_NAME = "weights-v2"
ALLOW_LONG_FLAG = "--allow-long-max-model-len"

# model_type -> the HF class name written back into a cached config.json.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str                  # a key of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or HF's llama3 / linear parameters: {"rope_type": "llama3", "factor": 8.0, ...}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v bias (Qwen2 always, Llama with attention_bias)
    o_proj_bias: bool = False          # Llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split into {self.num_kv_heads} kv groups")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear"):
                raise ValueError(f"rope scaling {kind!r} is not supported (llama3 and linear are)")

    @classmethod
    def read(cls, path: Path) -> "ModelConfig":
        """The model's shape alone, without its weights (a GGUF's metadata is memory-mapped), and
        without torch: the launcher checks flags against it before anything starts."""
        path = Path(path)
        if not path.is_dir() and path.suffix == ".gguf":
            from modelfiles.resolve import cache_dir
            cached = cache_dir(path, WEIGHTS_CACHE_NAME)
            if not (cached / "config.json").exists():
                import gguf
                return cls.from_gguf(gguf.GGUFReader(str(path)))
            path = cached
        return cls.from_hf_config(json.loads((path / "config.json").read_text()))

    def context_refusal(self, max_model_len: int | None, allow_long: bool) -> str | None:
        """Why --max-model-len cannot be served, or None. Past the positions the model was trained
        on, RoPE extrapolates and answers degrade without an error, so, as vLLM does, only on
        request."""
        if max_model_len is None or max_model_len <= self.max_position_embeddings or allow_long:
            return None
        return (f"--max-model-len {max_model_len} is beyond the {self.max_position_embeddings} "
                f"positions the model was trained on (max_position_embeddings); {ALLOW_LONG_FLAG} "
                f"serves it anyway, with answers that degrade past them")

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {model_type!r} "
                             f"(architectures {cfg.get('architectures')})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu is)")
        num_heads = cfg["num_attention_heads"]
        # transformers 5 nests theta and scaling in rope_parameters; older files keep them flat.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        rope_scaling = None
        if kind not in (None, "default"):
            rope_scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            rope_scaling["rope_type"] = kind
            rope_scaling.pop("type", None)
        eos = cfg.get("eos_token_id")
        llama_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or llama_bias,
            o_proj_bias=model_type != "qwen2" and llama_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that both this module and transformers read back as the same model."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        cfg = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                             else self.eos_token_ids or None),
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
        }
        if self.architecture != "qwen2":
            cfg["attention_bias"] = self.o_proj_bias
            cfg["mlp_bias"] = self.mlp_bias
        return cfg

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf(cls, reader, tensor_names: set[str] | None = None) -> "ModelConfig":
        """From a gguf.GGUFReader. tensor_names tells which optional weights (biases, output) exist."""
        def get(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        arch = get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
        names = tensor_names if tensor_names is not None else {t.name for t in reader.tensors}
        # llama.cpp stores Mistral as llama; only the name tells them apart, and the math is the same.
        model_type = arch
        if arch == "llama" and "mistral" in str(get("general.name", "")).lower():
            model_type = "mistral"
        num_heads = get(f"{arch}.attention.head_count")
        hidden = get(f"{arch}.embedding_length")
        vocab = get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else next(
                t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight")
        rope_scaling = None
        if get(f"{arch}.rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": get(f"{arch}.rope.scaling.factor")}
        if "rope_freqs.weight" in names:
            # llama3-style scaling baked into per-dimension factors; not mapped back yet.
            raise ValueError("GGUF files with rope_freqs (llama3.1 rope scaling) are not supported yet")
        eos = get("tokenizer.ggml.eos_token_id")
        eot = get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(x) for x in (eos, eot) if x is not None]
        template = get("tokenizer.chat_template")
        if template:  # the template's end-of-turn token ends an instruct model's answers
            special = gguf_special_tokens(get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type"))
            eos_ids += end_of_turn_ids(template, special)
        return cls(
            architecture=model_type,
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            num_layers=int(get(f"{arch}.block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(get(f"{arch}.attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            o_proj_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
        )
