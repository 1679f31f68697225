"""Speculative decoding with method suffix (worker/speculation/suffix_proposer.py: drafts as long as their
match, up to 16 tokens, never paused by the scheduler) over the real stack and the real model:
greedy answers are transformers' tokens, ending where transformers' end, preempted in a crowded
pool, with most of a copied answer's tokens coming from accepted proposals. The prompts,
their asserted margins and the checks are test_integration_speculation's: a 1-row and a 17-row
verification cannot disagree on a near-tie."""
from __future__ import annotations

import pytest

from tests.integration.test_integration_api import hf_tokenizer  # noqa: F401
# spec_stub connects to this module's `spec`, the suffix cluster.
from tests.integration.test_integration_speculation import (  # noqa: F401
    answers_in_a_crowd, reference, spec_cluster, spec_stub)

pytestmark = pytest.mark.integration

SPEC = {"method": "suffix", "num_speculative_tokens": 16}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    yield from spec_cluster(tmp_path_factory, SPEC)


def test_greedy_answers_preempted_in_a_crowd_are_transformers_tokens(spec, spec_stub, reference):
    before, after = answers_in_a_crowd(spec, spec_stub, reference)
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_drafts - before.spec_num_drafts
    copied = 2 * sum(len(reference[n][1]) for n in ("rewrite", "json"))
    # The copied answers alone would give this many tokens from accepted proposals.
    assert accepted > copied / 2 and drafts > 0, (accepted, drafts, copied, after)
    assert len(after.spec_num_accepted_tokens_per_pos) == SPEC["num_speculative_tokens"]
    assert after.spec_num_accepted_tokens_per_pos[8] > 0  # drafts longer than n-gram's 4 were kept
    assert spec.metric("pagoda_spec_decode_num_accepted_tokens_total") == after.spec_num_accepted_tokens
