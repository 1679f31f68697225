"""Speculative decoding with a draft model (--speculative-config method draft_model) over the real
stack: SmolLM2 as its own draft proposes transformers' greedy tokens, so every proposal is
accepted; a smaller draft (SmolLM2's first 4 layers under its head, so a draft cache of another
shape) proposes wrong tokens most of the time, and the answers are still transformers' tokens,
preempted in a crowded pool (the unit tests' drafts are noisy copies); a seeded
sampled request gives the same tokens every time. The prompts' greedy paths keep a margin
between their top two logits (asserted), so that a 1-row and a 5-row forward cannot disagree."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from safetensors.torch import load_file, save_file

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster
from tests.integration.test_integration_api import IM_END, chat_ids, hf_tokenizer  # noqa: F401
from tests.greedy_paths import answer, greedy_paths
from tests.integration.test_integration_speculation import MAX_TOKENS as PATH_TOKENS
from tests.integration.test_integration_speculation import MIN_MARGIN, PROMPTS, _streamed, greedy, loads

pytestmark = pytest.mark.integration

K = 4
MAX_TOKENS = 20
NAMES = ("rewrite", "rename", "count", "json")
DRAFT_LAYERS = 4  # of the target's 30: it proposes the target's next token about one time in ten


def draft_spec(model: str, k: int) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def reference(smollm2_hf, hf_tokenizer):  # noqa: F811
    """Each prompt's ids and transformers' greedy path of MAX_TOKENS, past the end of the answer
    too (as with ignore_eos), with the margin asserted all along."""
    paths = greedy_paths(smollm2_hf, {n: chat_ids(hf_tokenizer, c) for n, c in PROMPTS.items()}, PATH_TOKENS)
    out = {}
    for name in NAMES:
        assert min(paths[name].margins[:MAX_TOKENS]) > MIN_MARGIN, name
        out[name] = (paths[name].ids, paths[name].path[:MAX_TOKENS])
    return out


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory):
    """SmolLM2's first DRAFT_LAYERS layers under its own final norm and head, as a HF folder: a
    smaller draft, with a cache of another shape than the target's."""
    from modelfiles.resolve import cache_dir, resolve_model
    from worker.loader import CACHE_FILE, CACHE_NAME, load_weights
    load_weights(resolve_model(""))  # converts the GGUF once, if no test did yet
    source = cache_dir(resolve_model(""), CACHE_NAME)
    out = tmp_path_factory.mktemp("shallow-draft")
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = DRAFT_LAYERS
    (out / "config.json").write_text(json.dumps(config))
    kept = lambda name: not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS  # noqa: E731
    save_file({n: w for n, w in load_file(str(source / CACHE_FILE)).items() if kept(n)}, str(out / CACHE_FILE))
    return str(out)


def _cluster(tmp_path_factory, draft: str, k: int, *flags: str) -> Cluster:
    log = tmp_path_factory.mktemp("draft-model") / "cluster.log"
    return Cluster("--dtype", "float32", "--speculative-config", draft_spec(draft, k), "--max-model-len",
                   "512", *flags, log_path=log).start()


def _run(c: Cluster, requests: list[pb.GenerateRequest],
         streamed: tuple[pb.GenerateRequest, ...] = ()) -> tuple[list, pb.WorkerLoad]:
    """Every request at once: the answers of `requests` (Generate), then the tokens by index of
    `streamed` (GenerateStream), and the worker's load after."""
    with grpc.insecure_channel(c.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        calls = [lambda r=r: stub.Generate(r, timeout=600) for r in requests]
        calls += [lambda r=r: _streamed(stub, r) for r in streamed]
        with ThreadPoolExecutor(len(calls)) as pool:
            got = list(pool.map(lambda call: call(), calls))
        return got, loads(stub)


def test_the_target_as_its_own_draft_has_every_proposal_accepted(tmp_path_factory, reference):
    # ignore_eos: the answers run the whole path, so every proposal falls where the margin holds.
    c = _cluster(tmp_path_factory, "smollm2", K)
    requests = [greedy(reference[n][0], MAX_TOKENS, ignore_eos=True) for n in NAMES]
    try:
        got, load = _run(c, requests)
    finally:
        assert c.stop() == 0, c.log_tail()
    for name, response in zip(NAMES, got):
        assert list(response.token_ids) == reference[name][1], name
    assert load.spec_num_draft_tokens > MAX_TOKENS  # rows speculated, several steps each
    assert load.spec_num_accepted_tokens == load.spec_num_draft_tokens, load


def test_a_shallow_draft_is_rejected_at_times_and_the_answers_stay_the_targets(
        tmp_path_factory, reference, shallow_draft):
    # 20 blocks of 16: the crowd outgrows the pool and is preempted.
    c = _cluster(tmp_path_factory, shallow_draft, K, "--num-gpu-blocks-override", "20",
                 "--max-num-seqs", "8")
    sampled = pb.GenerateRequest(prompt_token_ids=reference["count"][0],
                                 sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=5, n=2),
                                 stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))
    crowd_names = list(NAMES[:3])  # with the two sampled streams, seven sequences: 20 blocks preempt
    try:
        crowd, load = _run(c, [greedy(reference[n][0], MAX_TOKENS) for n in crowd_names],
                           streamed=(sampled, sampled))
        preemptions = c.metric("pagoda_num_preemptions_total")
    finally:
        assert c.stop() == 0, c.log_tail()
    assert f": {DRAFT_LAYERS} layers, 576 hidden" in c.log_path.read_text()  # its own cache shape
    for name, response in zip(crowd_names, crowd):
        assert list(response.token_ids) == answer(reference[name][1], IM_END), name
    assert preemptions > 0
    first, again = crowd[-2:]  # a seeded n = 2 request, twice in the same crowd
    assert first == again and len(first[0]) == MAX_TOKENS and first[0] != first[1]
    assert 0 < load.spec_num_accepted_tokens < load.spec_num_draft_tokens, load
