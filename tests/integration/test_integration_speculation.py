"""Speculative decoding (--speculative-config, n-gram) with the real model over the real stack:
greedy answers are transformers' tokens, ending where transformers' end, preempted in a crowded
pool, a quarter of them from accepted proposals; stop strings and stop ids inside accepted runs end the answer exactly there; a
seeded sampled request gives what the non-speculative session cluster gives; logprobs come for
every accepted token and equal the session cluster's; GetLoads and Prometheus count
drafts and accepted tokens. Every prompt's greedy path keeps a margin between its top two
logits (asserted), so that a 1-row and a 5-row verification cannot disagree on a near-tie."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster
from tests.greedy_paths import answer, greedy_paths
from tests.integration.test_integration_api import IM_END, chat_ids, hf_tokenizer  # noqa: F401

pytestmark = pytest.mark.integration

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PARA = ("The scheduler owns the queues and the block tables. Every iteration it sends a plan to "
        "the workers, which run the forward pass and send back the sampled tokens.")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = {  # text that repeats its context, and one answer that does not
    "rewrite": f"Repeat the following text word for word:\n\n{PARA}",
    "rename": f"Rename the function add to plus in this code and show the whole code:\n\n{CODE}",
    "json": 'Copy this JSON exactly: {"name": "pagoda", "workers": 4, "blocks": 1024, "cache": true}',
    "count": "Count from 1 to 30, separated by commas.",
    "question": "Why is the sky blue?",
}
MAX_TOKENS = 48  # the draft-model module reads the same paths
MIN_MARGIN = 0.02  # logits; fp32 kernels of different query lengths differ by ~1e-5


def spec_cluster(tmp_path_factory, spec: dict):
    """A cluster speculating with `spec`, stopped after the module; 24 blocks of 16: each prompt
    fits alone with its lookahead slots; ten at once outgrow the pool and preempt."""
    log = tmp_path_factory.mktemp(spec["method"]) / "cluster.log"
    c = Cluster("--dtype", "float32", "--speculative-config", json.dumps(spec),
                "--num-gpu-blocks-override", "24", "--max-num-seqs", "16", "--max-model-len", "1024",
                log_path=log).start()
    yield c
    assert c.stop() == 0, c.log_tail()


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    yield from spec_cluster(tmp_path_factory, SPEC)


@pytest.fixture(scope="module")
def spec_stub(spec):
    with grpc.insecure_channel(spec.target) as ch:
        yield pagoda_pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def reference(smollm2_hf, hf_tokenizer):  # noqa: F811
    """Each prompt's ids and transformers' greedy answer (EOS included where it stops)."""
    paths = greedy_paths(smollm2_hf, {n: chat_ids(hf_tokenizer, c) for n, c in PROMPTS.items()}, MAX_TOKENS)
    out = {}
    for name, p in paths.items():
        expected = answer(p.path, IM_END)
        assert min(p.margins[:len(expected)]) > MIN_MARGIN, name
        out[name] = (p.ids, expected)
    return out


def greedy(ids, max_tokens=MAX_TOKENS, **stopping) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, **stopping))


def on_both(spec_stub, stub, requests: list[pb.GenerateRequest]) -> tuple[list, list]:
    """Every request at once on each cluster in turn (two busy workers on two cores would only
    contend): the speculating cluster's answers, then the plain's."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return tuple(list(pool.map(lambda r, s=s: s.Generate(r, timeout=300), requests))
                     for s in (spec_stub, stub))


def loads(stub) -> pb.WorkerLoad:
    (worker,) = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).workers
    return worker


def answers_in_a_crowd(cluster, stub, reference) -> tuple[pb.WorkerLoad, pb.WorkerLoad]:
    """Every prompt twice at once: preempted, each still transformers' answer; no block left.
    The worker's load before and after."""
    before, preempted = loads(stub), cluster.metric("pagoda_num_preemptions_total")
    crowd = [name for name in reference for _ in range(2)]
    with ThreadPoolExecutor(len(crowd)) as pool:
        got = list(pool.map(lambda n: stub.Generate(greedy(reference[n][0]), timeout=600), crowd))
    assert cluster.metric("pagoda_num_preemptions_total") > preempted
    for name, answer in zip(crowd, got):
        assert list(answer.token_ids) == reference[name][1], name
    after = loads(stub)
    assert after.kv_blocks_used == 0
    return before, after


def test_greedy_answers_preempted_in_a_crowd_are_transformers_tokens(spec, spec_stub, reference):
    before, after = answers_in_a_crowd(spec, spec_stub, reference)
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_drafts - before.spec_num_drafts
    tokens = 2 * sum(len(e) for _, e in reference.values())
    # A quarter of the answers' tokens came from accepted proposals, at no extra step.
    assert accepted > tokens / 4 and drafts > 0, (accepted, drafts, tokens, after)
    assert after.spec_mean_acceptance_length == pytest.approx(
        1 + after.spec_num_accepted_tokens / after.spec_num_drafts)
    assert len(after.spec_num_accepted_tokens_per_pos) == SPEC["num_speculative_tokens"]
    assert after.spec_num_accepted_tokens_per_pos[0] >= after.spec_num_accepted_tokens_per_pos[-1]
    assert spec.metric("pagoda_spec_decode_num_accepted_tokens_total") == after.spec_num_accepted_tokens
    assert spec.metric("pagoda_spec_decode_num_draft_tokens_total") == after.spec_num_draft_tokens


def test_stops_inside_accepted_runs_end_the_answer_exactly_there(spec_stub, reference, hf_tokenizer):  # noqa: F811
    ids, expected = reference["rewrite"]
    text = hf_tokenizer.decode(expected, skip_special_tokens=True)
    got = spec_stub.Generate(greedy(ids, stop=["forward pass"]), timeout=300)
    assert got.text == text[:text.index("forward pass")]
    assert got.finish_reason == pb.FINISH_REASON_STOP and got.matched_stop_str == "forward pass"
    ids, expected = reference["count"]
    stop_id = expected[41]  # a digit deep in a run of accepted proposals
    cut = expected.index(stop_id) + 1
    got = spec_stub.Generate(greedy(ids, stop_token_ids=[stop_id]), timeout=300)
    assert list(got.token_ids) == expected[:cut] and got.matched_token_id == stop_id
    got = spec_stub.Generate(greedy(ids, max_tokens=23), timeout=300)
    assert list(got.token_ids) == expected[:23] and got.finish_reason == pb.FINISH_REASON_LENGTH


SAMPLED_TOKENS = 24


def _sampled(ids) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=ids,
                              sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=11, n=2),
                              stopping=pb.StoppingCriteria(max_tokens=SAMPLED_TOKENS, ignore_eos=True))


def _streamed(stub, request) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for msg in stub.GenerateStream(request, timeout=300):
        out.setdefault(msg.index, []).extend(msg.token_ids)
    return out


def test_seeded_sampling_gives_what_the_plain_cluster_gives(spec_stub, stub, reference):
    """Each position is drawn as the plain sampler draws it (worker/speculation/rejection_sampler.py), so
    speculation changes how many tokens a step gives, not which: alone, in a batch, every time."""
    names = ("rename", "question")  # long accepted runs; open text, whose two draws differ soon
    alone = _streamed(spec_stub, _sampled(reference["rename"][0]))
    with ThreadPoolExecutor(2) as pool:
        plain = dict(zip(names, pool.map(lambda n: _streamed(stub, _sampled(reference[n][0])), names)))
    with ThreadPoolExecutor(4) as pool:
        crowd = list(pool.map(lambda n: _streamed(spec_stub, _sampled(reference[n][0])),
                              names + ("json", "count")))
    assert alone == plain["rename"]
    for i, n in enumerate(names):
        assert plain[n] == crowd[i], n
        assert len(plain[n][0]) == len(plain[n][1]) == SAMPLED_TOKENS
    assert plain["question"][0] != plain["question"][1]  # each of n draws from a stream of its own


def test_logprobs_of_every_accepted_token_equal_the_plain_clusters(spec_stub, stub, reference):
    ids, expected = reference["rewrite"]  # a quoted paragraph: long accepted runs
    request = greedy(ids, max_tokens=48)
    request.sampling.logprobs = 2
    before = loads(spec_stub)
    got, plain = spec_stub.Generate(request, timeout=300), stub.Generate(request, timeout=300)
    after = loads(spec_stub)
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens  # runs, not steps
    assert list(got.token_ids) == list(plain.token_ids)
    assert list(got.token_ids) == expected and len(got.logprobs) == len(expected)
    for a, b in zip(got.logprobs, plain.logprobs):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
    # A stop id inside a run: the answer and its logprobs end at the same token.
    request.stopping.stop_token_ids.append(expected[20])
    cut = spec_stub.Generate(request, timeout=300)
    assert list(cut.token_ids) == expected[:expected.index(expected[20]) + 1]
    assert [lp.token_id for lp in cut.logprobs] == list(cut.token_ids)


def test_penalties_bias_and_min_tokens_act_at_every_verified_position(spec_stub, stub, reference):
    """The processors that read the history see the proposals before each position as if they
    had been sampled: greedy and seeded answers equal the plain cluster's, and they speculated."""
    before = loads(spec_stub).spec_num_drafts
    requests = []
    for name in ("rewrite", "count"):
        ids, expected = reference[name]
        for sampling in (dict(temperature=0, repetition_penalty=1.15, presence_penalty=0.3),
                         dict(temperature=0, frequency_penalty=0.2, logit_bias={expected[3]: -5.0}),
                         dict(temperature=0.7, seed=5, presence_penalty=0.4, repetition_penalty=1.1)):
            requests.append(pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(**sampling),
                                               stopping=pb.StoppingCriteria(max_tokens=32, min_tokens=24)))
    got, plain = on_both(spec_stub, stub, requests)
    for request, g, p in zip(requests, got, plain):
        assert list(g.token_ids) == list(p.token_ids), request.sampling
        assert len(g.token_ids) >= 24
    assert loads(spec_stub).spec_num_drafts > before


SERVICE = {"type": "object", "properties": {"name": {"type": "string"}, "workers": {"type": "integer"},
                                            "blocks": {"type": "integer"}, "cache": {"type": "boolean"}},
           "required": ["name", "workers", "blocks", "cache"], "additionalProperties": False}


def test_structured_answers_verify_proposals_against_the_grammar(spec_stub, stub, reference):
    """The grammar masks each verified position as it would stand there: the answer is the
    plain cluster's, it validates against its schema, and proposals were accepted."""
    import jsonschema
    ids, _ = reference["json"]
    before = loads(spec_stub).spec_num_accepted_tokens
    requests = [pb.GenerateRequest(prompt_token_ids=ids, stopping=pb.StoppingCriteria(max_tokens=64),
                                   sampling=pb.SamplingParams(**sampling, structured_output=pb.StructuredOutput(
                                       json_schema=json.dumps(SERVICE))))
                for sampling in (dict(temperature=0), dict(temperature=0.8, seed=3))]
    got, plain = on_both(spec_stub, stub, requests)
    for request, g, p in zip(requests, got, plain):
        assert list(g.token_ids) == list(p.token_ids), request.sampling
        jsonschema.validate(json.loads(g.text), SERVICE)
        assert g.finish_reason == pb.FINISH_REASON_STOP
    assert loads(spec_stub).spec_num_accepted_tokens > before
