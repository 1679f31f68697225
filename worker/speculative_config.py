"""--speculative-config, vLLM's flag and field names: which proposer, and how many tokens it
proposes a step. Parsed and checked once, where the flag is read, so that a bad value stops the
worker at start-up with a message naming the field.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}

ngram: only one of prompt_lookup_min / _max given sets both; neither gives 2..5.
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

METHODS = ("ngram", "draft_model")
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
                 "disable_by_batch_size"}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r}; known: {sorted(known)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config.method must be one of {list(METHODS)}, got {method!r}")
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        batch = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 0, MAX_BATCH)
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


def _int(raw: dict, name: str, default, lo: int, hi: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"--speculative-config.{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value
