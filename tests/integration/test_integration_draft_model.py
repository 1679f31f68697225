"""Speculative decoding with a draft model (--speculative-config method draft_model) over the real
stack, one cluster with SmolLM2 as its own draft: under greedy it proposes transformers' greedy
tokens, so every proposal is accepted, preempted or not (any stale KV in the draft's cache would
show as a rejection); under sampling its greedy proposals are rejected at times, and the greedy
answers beside them are still transformers' tokens, preempted in a crowded pool; a seeded sampled
request gives the same tokens every time. Drafts that differ from the target (a noisy copy, a
smaller model whose cache has another shape) are tests/unit/worker/test_worker_draft_model.py's,
on tiny checkpoints. The prompts' greedy paths keep a margin between their top two logits
(asserted), so that a 1-row and a 5-row forward cannot disagree."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster
from tests.integration.test_integration_api import IM_END, chat_ids, hf_tokenizer  # noqa: F401
from tests.greedy_paths import answer, greedy_paths
from tests.integration.test_integration_speculation import MAX_TOKENS as PATH_TOKENS
from tests.integration.test_integration_speculation import MIN_MARGIN, PROMPTS, _streamed, greedy, loads

pytestmark = pytest.mark.integration

K = 4
# Each answer grows by 40 tokens and 4 proposals, about 3 blocks: any 3 admitted together outgrow
# the 14-block pool. With 20, 3 answers admitted together just fitted and ended without a
# preemption when they arrived at once (the test passed only when they arrived apart).
MAX_TOKENS = 40
NAMES = ("rewrite", "rename", "count", "json")


def draft_spec(model: str, k: int) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def reference(smollm2_hf, hf_tokenizer):  # noqa: F811
    """Each prompt's ids and transformers' greedy path of MAX_TOKENS, past the end of the answer
    too (as with ignore_eos), with the margin asserted all along (NAMES only: the others are
    sampled)."""
    paths = greedy_paths(smollm2_hf, {n: chat_ids(hf_tokenizer, c) for n, c in PROMPTS.items()}, PATH_TOKENS)
    out = {}
    for name, p in paths.items():
        assert name not in NAMES or min(p.margins[:MAX_TOKENS]) > MIN_MARGIN, name
        out[name] = (p.ids, p.path[:MAX_TOKENS])
    return out


def _run(c: Cluster, requests: list[pb.GenerateRequest],
         streamed: tuple[pb.GenerateRequest, ...] = ()) -> tuple[list, pb.WorkerLoad]:
    """Every request at once: the answers of `requests` (Generate), then the tokens by index of
    `streamed` (GenerateStream), and the worker's load after. At once: the channel is connected
    first and the calls leave together, so that no call comes in after the others ended."""
    with grpc.insecure_channel(c.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        loads(stub)  # connected
        calls = [lambda r=r: stub.Generate(r, timeout=600) for r in requests]
        calls += [lambda r=r: _streamed(stub, r) for r in streamed]
        start = threading.Barrier(len(calls))

        def together(call):
            start.wait(timeout=60)
            return call()
        with ThreadPoolExecutor(len(calls)) as pool:
            got = list(pool.map(together, calls))
        return got, loads(stub)


def test_the_target_as_its_own_draft_is_accepted_whole_under_greedy_and_rejected_at_times_sampled(
        tmp_path_factory, reference):
    # 14 blocks of 16: four answers at once, and the crowd, outgrow the pool and are preempted.
    log = tmp_path_factory.mktemp("draft-model") / "cluster.log"
    c = Cluster("--dtype", "float32", "--speculative-config", draft_spec("smollm2", K), "--max-model-len",
                "512", "--num-gpu-blocks-override", "14", "--max-num-seqs", "8", log_path=log).start()
    # ignore_eos: the answers run the whole path, so every proposal falls where the margin holds.
    greedy_all = [greedy(reference[n][0], MAX_TOKENS, ignore_eos=True) for n in NAMES]
    sampled = pb.GenerateRequest(prompt_token_ids=reference["question"][0],  # open text
                                 sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=5, n=2),
                                 stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))
    crowd_names = ("rewrite", "rename", "count")  # with the two sampled streams, seven sequences
    try:
        whole, greedy_load = _run(c, greedy_all)
        preempted_greedy = c.metric("pagoda_num_preemptions_total")
        crowd, load = _run(c, [greedy(reference[n][0], MAX_TOKENS) for n in crowd_names],
                           streamed=(sampled, sampled))
        preemptions = c.metric("pagoda_num_preemptions_total")
    finally:
        assert c.stop() == 0, c.log_tail()
    for name, response in zip(NAMES, whole):
        assert list(response.token_ids) == reference[name][1], name
    assert greedy_load.spec_num_draft_tokens > MAX_TOKENS  # rows speculated, several steps each
    assert greedy_load.spec_num_accepted_tokens == greedy_load.spec_num_draft_tokens, greedy_load
    assert preempted_greedy > 0
    for name, response in zip(crowd_names, crowd):
        assert list(response.token_ids) == answer(reference[name][1], IM_END), name
    assert preemptions > preempted_greedy
    first, again = crowd[-2:]  # a seeded n = 2 request, twice in the same crowd
    assert first == again and len(first[0]) == MAX_TOKENS and first[0] != first[1]
    accepted = load.spec_num_accepted_tokens - greedy_load.spec_num_accepted_tokens
    drafted = load.spec_num_draft_tokens - greedy_load.spec_num_draft_tokens
    assert 0 < accepted < drafted, load
