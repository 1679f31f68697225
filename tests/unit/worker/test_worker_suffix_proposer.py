"""Suffix proposals (worker/speculation/suffix_proposer.py) against a plain-Python reference over random token
sequences, the draft's length following its match, and --speculative-config's suffix fields
(vLLM's names and defaults, errors naming the field)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from worker.speculation.config import SpeculativeConfig
from worker.speculation.suffix_proposer import propose


def reference(tokens: list[int], k: int, depth: int, factor: float, min_prob: float) -> list[int]:
    """The longest L <= depth such that the last L tokens also end at an earlier position p; from
    those places, at each step the token most of them continue with (the latest on a tie), while
    the product of the chosen tokens' shares stays at or above min_prob; up to
    min(k, max(1, int(factor * L))) tokens."""
    size = len(tokens)
    for length in range(min(depth, size - 1), 0, -1):
        places = [p for p in range(length, size) if tokens[p - length:p] == tokens[size - length:]]
        if places:
            break
    else:
        return []
    out, share = [], 1.0
    for j in range(min(k, max(1, int(factor * length)))):
        places = [p for p in places if p + j < size]
        if not places:
            break
        counts = Counter(tokens[p + j] for p in places)
        most = max(counts.values())
        token = [tokens[p + j] for p in places if counts[tokens[p + j]] == most][-1]
        share *= most / len(places)
        if share < min_prob:
            break
        out.append(token)
        places = [p for p in places if tokens[p + j] == token]
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 17), st.integers(1, 8),
       st.sampled_from([0.5, 1.0, 2.0, 4.0]), st.sampled_from([0.0, 0.1, 0.4, 0.9]))
def test_proposals_equal_the_reference(tokens, k, depth, factor, min_prob):
    got = propose(np.array(tokens, dtype=np.int64), k, depth, factor, min_prob)
    assert got.tolist() == reference(tokens, k, depth, factor, min_prob)


def test_a_long_match_proposes_long_and_a_short_one_short():
    quote = list(range(10, 40))
    # The answer is quoting the passage: 12 tokens matched, so up to 12 proposed.
    assert propose(np.array(quote + [1] + quote[:12]), 16, 24, 1.0, 0.1).tolist() == quote[12:24]
    assert propose(np.array(quote + [1] + quote[:12]), 16, 24, 2.0, 0.1).tolist() == quote[12:28]
    # One token matched (7 occurred once, followed by 8): one proposal at factor 1.
    assert propose(np.array([7, 8, 9, 3, 7]), 16, 24, 1.0, 0.1).tolist() == [8]
    assert propose(np.array([1, 2, 3, 4]), 16, 24, 1.0, 0.1).tolist() == []


def test_an_uncertain_continuation_is_not_proposed():
    # 5 was followed by 1, 2 and 3: each a third of the places, under a min_prob of 0.5.
    tokens = np.array([5, 1, 5, 2, 5, 3, 5])
    assert propose(tokens, 4, 24, 1.0, 0.5).tolist() == []
    assert propose(tokens, 4, 24, 1.0, 0.3).tolist() == [3]   # a tie goes to the latest
    # Twice 5 6 then 8, once 5 6 then 9: the majority's continuation.
    assert propose(np.array([5, 6, 8, 5, 6, 8, 5, 6, 9, 0, 5, 6]), 1, 24, 1.0, 0.5).tolist() == [8]


def test_speculative_config_takes_vllms_suffix_fields_and_names_the_bad_one():
    c = SpeculativeConfig.parse('{"method": "suffix"}')
    assert (c.method, c.num_speculative_tokens, c.suffix_decoding_max_tree_depth,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == ("suffix", 16, 24, 1.0, 0.1)
    assert c.paced_by_worker and not SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').paced_by_worker
    d = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 6, '
                                '"suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0}')
    assert (d.num_speculative_tokens, d.suffix_decoding_max_tree_depth, d.suffix_decoding_max_spec_factor,
            d.suffix_decoding_min_token_prob) == (8, 6, 2.0, 0.0)
    assert SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 4}').num_speculative_tokens == 4
    for text, field in [('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "suffix_decoding_min_token_prob"),
                        ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "suffix_decoding_max_spec_factor"),
                        ('{"method": "suffix", "suffix_decoding_max_spec_factor": "2"}', "suffix_decoding_max_spec_factor"),
                        ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth"),
                        ('{"method": "suffix", "num_speculative_tokens": 17}', "num_speculative_tokens"),
                        ('{"method": "suffix", "prompt_lookup_max": 3}', "prompt_lookup_max"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3}',
                         "suffix_decoding_max_tree_depth"),
                        ('{"method": "suffix", "suffix_decoding_max_cached_requests": 3}',
                         "suffix_decoding_max_cached_requests")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(text)
