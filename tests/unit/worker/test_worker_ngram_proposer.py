"""n-gram proposals (worker/speculation/ngram_proposer.py) against a plain-Python reference over random
token sequences, and --speculative-config's parsing (vLLM's field names, errors naming the field)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from worker.speculation.ngram_proposer import propose
from worker.speculation.config import SpeculativeConfig


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n suffix occurred earlier (ending before the
    last token); the k tokens after its latest such occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 6),
       st.integers(1, 4), st.integers(0, 3))
def test_proposals_equal_the_reference(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = propose(np.array(tokens, dtype=np.int64), k, min_n, max_n)
    assert got.tolist() == reference(tokens, k, min_n, max_n)


def test_a_quoted_passage_is_proposed_as_it_continued():
    text = [7, 8, 9, 10, 11, 12, 13, 1, 2, 7, 8, 9]
    assert propose(np.array(text), 3, 2, 4).tolist() == [10, 11, 12]
    assert propose(np.array([1, 2, 3, 4]), 3, 1, 3).tolist() == []


def test_speculative_config_takes_vllms_fields_and_names_the_bad_one():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 5)
    only_max = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    d = SpeculativeConfig.parse('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}')
    assert (d.method, d.model, d.num_speculative_tokens) == ("draft_model", "/m", 2)
    assert c.disable_by_batch_size == 8  # pagoda's default on the CPU (vLLM's: never)
    never = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}')
    assert never.disable_by_batch_size == 0
    for text, field in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
                         '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}',
                         "'speculative_model'"),
                        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}',
                         "disable_by_batch_size"),
                        ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(text)
