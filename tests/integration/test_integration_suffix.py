"""Speculative decoding with method suffix (worker/suffix_proposer.py: drafts as long as their
match, up to 16 tokens, never paused by the scheduler) over the real stack and the real model:
greedy answers are transformers' tokens, ending where transformers' end, alone and preempted in a
crowded pool, with most of a copied answer's tokens coming from accepted proposals. The prompts
and their asserted margins are test_integration_speculation's: a 1-row and a 17-row
verification cannot disagree on a near-tie."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster
from tests.integration.test_integration_api import IM_END, chat_ids, hf_tokenizer  # noqa: F401
from tests.integration.test_integration_speculation import greedy, loads, reference  # noqa: F401

pytestmark = pytest.mark.integration

SPEC = {"method": "suffix", "num_speculative_tokens": 16}


@pytest.fixture(scope="module")
def suffix(tmp_path_factory):
    # 24 blocks of 16: each prompt fits alone with its 16 lookahead slots; ten at once preempt.
    log = tmp_path_factory.mktemp("suffix") / "cluster.log"
    c = Cluster("--dtype", "float32", "--speculative-config", json.dumps(SPEC),
                "--num-gpu-blocks-override", "24", "--max-num-seqs", "16", "--max-model-len", "1024",
                log_path=log).start()
    yield c
    assert c.stop() == 0, c.log_tail()


@pytest.fixture(scope="module")
def suffix_stub(suffix):
    with grpc.insecure_channel(suffix.target) as ch:
        yield pagoda_pb2_grpc.GenerationStub(ch)


def test_greedy_answers_alone_are_transformers_tokens(suffix, suffix_stub, reference):
    before = loads(suffix_stub)
    for name, (ids, expected) in reference.items():
        got = suffix_stub.Generate(greedy(ids), timeout=300)
        assert list(got.token_ids) == expected, name
        ends = expected[-1] == IM_END
        assert got.finish_reason == (pb.FINISH_REASON_STOP if ends else pb.FINISH_REASON_LENGTH), name
    after = loads(suffix_stub)
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_drafts - before.spec_num_drafts
    copied = sum(len(reference[n][1]) for n in ("rewrite", "json"))
    # The copied answers alone would give this many tokens from accepted proposals.
    assert accepted > copied / 2 and drafts > 0, (accepted, drafts, copied, after)
    assert len(after.spec_num_accepted_tokens_per_pos) == SPEC["num_speculative_tokens"]
    assert after.spec_num_accepted_tokens_per_pos[8] > 0  # drafts longer than n-gram's 4 were kept
    assert suffix.metric("pagoda_spec_decode_num_accepted_tokens_total") == after.spec_num_accepted_tokens


def test_greedy_answers_preempted_in_a_crowd_are_transformers_tokens(suffix, suffix_stub, reference):
    before = suffix.metric("pagoda_num_preemptions_total")
    crowd = [name for name in reference for _ in range(2)]
    with ThreadPoolExecutor(len(crowd)) as pool:
        got = list(pool.map(lambda n: suffix_stub.Generate(greedy(reference[n][0]), timeout=600), crowd))
    assert suffix.metric("pagoda_num_preemptions_total") > before
    for name, answer in zip(crowd, got):
        assert list(answer.token_ids) == reference[name][1], name
    assert loads(suffix_stub).kv_blocks_used == 0
