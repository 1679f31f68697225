"""Workloads shared by bench/offline.py and bench/serve.py: prompts as token ids, so that every
peer (pagoda over gRPC, transformers in process) sees exactly the same input, whatever its
tokenizer or chat template would have made of a text."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# SmolLM2's ids 0..16 are its special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...): a
# random prompt avoids them so that no peer sees an end-of-turn in the middle of its input.
FIRST_ORDINARY_ID = 17
SMOLLM2_VOCAB = 49152


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """Short requests are common and long ones rare, as in real traffic; uniform in log space
    gives each doubling of length the same weight."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def random_ids(rng: random.Random, n: int, vocab: int = SMOLLM2_VOCAB) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def offline_workload(n: int, seed: int, prompt_range=(16, 384), output_range=(8, 192),
                     vocab: int = SMOLLM2_VOCAB) -> list[Request]:
    """The default workload of bench/offline.py (the length ranges of bench/bench_kv.py)."""
    rng = random.Random(seed)
    lengths = [(log_uniform(rng, *prompt_range), log_uniform(rng, *output_range)) for _ in range(n)]
    return [Request(random_ids(rng, p, vocab), o) for p, o in lengths]


def _around(rng: random.Random, length: int, ratio: float) -> int:
    """vLLM's --random-range-ratio: uniform in [length * (1 - r), length * (1 + r)]."""
    lo, hi = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return rng.randint(lo, hi)


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   vocab: int = SMOLLM2_VOCAB, salt: int = 0) -> list[Request]:
    """vLLM bench serve's `random` dataset, on token ids. Lengths come from `seed` alone and ids
    from (seed, salt), so that the runs of a rate sweep share lengths but never hit the prefix
    cache on each other's prompts."""
    lens, ids = random.Random(seed), random.Random(f"{seed}/{salt}")
    return [Request(random_ids(ids, _around(lens, input_len, range_ratio), vocab),
                    _around(lens, output_len, range_ratio)) for _ in range(n)]


def prefix_dataset(n: int, prefix_len: int, input_len: int, output_len: int, range_ratio: float,
                   num_prefixes: int, seed: int, vocab: int = SMOLLM2_VOCAB, salt: int = 0) -> list[Request]:
    """A shared prefix (a system prompt, a document) followed by a random suffix per request:
    what the prefix cache is for. Requests cycle through `num_prefixes` prefixes."""
    lens, ids = random.Random(seed), random.Random(f"{seed}/{salt}")
    prefixes = [random_ids(ids, prefix_len, vocab) for _ in range(max(1, num_prefixes))]
    return [Request(prefixes[i % len(prefixes)] + random_ids(ids, _around(lens, input_len, range_ratio), vocab),
                    _around(lens, output_len, range_ratio)) for i in range(n)]


def load_hf_model(dtype: str):
    """transformers' own model from the GGUF file pagoda serves (as tests/conftest.py's
    smollm2_hf does), in the dtype asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    from modelfiles.resolve import resolve_model
    path = resolve_model("")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=getattr(torch, dtype)).eval()
