"""--speculative-config, vLLM's flag and field names: which proposer, and how many tokens it
proposes a step. Parsed and checked once, where the flag is read, so that a bad value stops the
worker at start-up with a message naming the field.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}
    {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}

ngram: only one of prompt_lookup_min / _max given sets both; neither gives 2..5.
suffix (worker/speculation/suffix_proposer.py): vLLM's defaults for its fields; num_speculative_tokens
defaults to the tree depth, capped at MAX_SPECULATIVE_TOKENS.
disable_by_batch_size (vLLM's field): no proposals in a step with more running sequences than
this. vLLM's default is never; pagoda's is DEFAULT_DISABLE_BY_BATCH_SIZE, because on the CPU a
step's cost grows with its rows from a few on (docs/benchmarks.md: at 16 streams of text that
does not repeat, speculation cost 9%); 0 means never.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# A verification is one row per proposal: bounded as a step is (GetLoads' size counts it too).
from proto.sizes import MAX_SPECULATIVE_TOKENS

METHODS = ("ngram", "draft_model", "suffix")
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor",
                 "suffix_decoding_min_token_prob")
MAX_TREE_DEPTH = 1024
MAX_LOOKUP = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MAX_BATCH = 1 << 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram
    prompt_lookup_max: int = 0
    model: str = ""             # draft_model
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    suffix_decoding_max_tree_depth: int = 24      # suffix: the longest match looked for
    suffix_decoding_max_spec_factor: float = 1.0  # proposals per matched token
    suffix_decoding_min_token_prob: float = 0.1   # the draft stops below this share

    @property
    def paced_by_worker(self) -> bool:
        """The proposer sizes each draft itself (suffix): the scheduler offers k every step."""
        return self.method == "suffix"

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """From the flag's JSON; ValueError naming the field."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "disable_by_batch_size", *SUFFIX_FIELDS}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r}; known: {sorted(known)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config.method must be one of {list(METHODS)}, got {method!r}")
        batch = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 0, MAX_BATCH)
        if method != "suffix" and (extra := [f for f in SUFFIX_FIELDS if f in raw]):
            raise ValueError(f"--speculative-config.{extra[0]} is for method suffix")
        if method == "suffix":
            return cls._suffix(raw, batch)
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("--speculative-config.model: draft_model needs the draft model's path")
            if "prompt_lookup_min" in raw or "prompt_lookup_max" in raw:
                raise ValueError("--speculative-config.prompt_lookup_min/max are for method ngram")
            return cls(method, k, model=model, disable_by_batch_size=batch)
        if "model" in raw:
            raise ValueError("--speculative-config.model is for method draft_model")
        lo = _int(raw, "prompt_lookup_min", raw.get("prompt_lookup_max", 2), 1, MAX_LOOKUP)
        hi = _int(raw, "prompt_lookup_max", raw.get("prompt_lookup_min", 5), 1, MAX_LOOKUP)
        if lo > hi:
            raise ValueError(f"--speculative-config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi, disable_by_batch_size=batch)


    @classmethod
    def _suffix(cls, raw: dict, batch: int) -> "SpeculativeConfig":
        for wrong in ("model", "prompt_lookup_min", "prompt_lookup_max"):
            if wrong in raw:
                raise ValueError(f"--speculative-config.{wrong} is not a field of method suffix")
        depth = _int(raw, "suffix_decoding_max_tree_depth", 24, 1, MAX_TREE_DEPTH)
        k = _int(raw, "num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS), 1, MAX_SPECULATIVE_TOKENS)
        factor = _float(raw, "suffix_decoding_max_spec_factor", 1.0, 1e-3, float(MAX_SPECULATIVE_TOKENS))
        prob = _float(raw, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0)
        return cls("suffix", k, disable_by_batch_size=batch, suffix_decoding_max_tree_depth=depth,
                   suffix_decoding_max_spec_factor=factor, suffix_decoding_min_token_prob=prob)


def _float(raw: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"--speculative-config.{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _int(raw: dict, name: str, default, lo: int, hi: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"--speculative-config.{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value
