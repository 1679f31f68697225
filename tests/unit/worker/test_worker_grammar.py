"""worker.grammar.matchers with the real tokenizer's vocabulary and xgrammar: answers walked through the
real Sampler under the mask parse and validate (jsonschema) or match their regex/choice, greedy
and sampled; a sequence added again replays to the same mask; a conflict is reported, never
sampled; the raw logits stay untouched."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from gateway.tokenizer import load_tokenizer
from modelfiles.resolve import resolve_model, tokenizer_json
from proto import internal_pb2
from structured.compiler import GrammarCache, tokenizer_info
from structured.spec import Spec, SpecError
from worker.grammar.matchers import GrammarRows, apply_grammar_mask, why_no_token
from worker.step.sampler import Sampler

VOCAB = 49152
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                 "required": ["city"], "additionalProperties": False},
        "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["tags", "home"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("")


@pytest.fixture(scope="module")
def cache(tok):
    return GrammarCache(tokenizer_info(tokenizer_json(resolve_model("")), VOCAB, tok.eos_token_ids))


def config(spec: Spec, temperature=0.0, seed=None, stop=(2,), **extra):
    c = internal_pb2.SamplingConfig(temperature=temperature, stop_token_ids=list(stop), **extra)
    if seed is not None:
        c.has_seed, c.seed = True, seed
    spec.to_proto(c.structured_output)
    return c


def walk(cache, cfg, seed: int, limit: int = 200) -> tuple[list[int], int]:
    """Samples under the grammar from random logits until a token < 0 or a stop id."""
    rows = GrammarRows(lambda: cache)
    rows.add(0, cfg, [])
    sampler = Sampler(torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(limit):
        logits = torch.randn(1, VOCAB, generator=gen) * 3
        mask = rows.mask([0], [0], VOCAB)
        token = int(sampler(logits, [cfg], [step], [out], [0], ([0], mask))[0])
        if token < 0 or token in cfg.stop_token_ids:
            return out, token
        out.append(token)
        rows.accept(np.array([0]), np.array([token]))
    raise AssertionError(f"no end after {limit} tokens: {out}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_answers_under_a_json_schema_validate(tok, cache, i, temperature):
    for seed in range(3):
        cfg = config(Spec("json_schema", json.dumps(SCHEMAS[i])), temperature, seed=seed)
        out, end = walk(cache, cfg, seed)
        assert end == 2  # ended by its stop token once complete
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMAS[i])


def test_regex_choice_and_grammar_answers_match(tok, cache):
    cases = [(Spec("regex", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"),
              lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", t)),
             (Spec("choice", choices=("yes", "no", "a.b(c)")), lambda t: t in ("yes", "no", "a.b(c)")),
             (Spec("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
              lambda t: re.fullmatch(r"\(\d+(\+\d+)*\)", t))]
    for spec, ok in cases:
        for seed in range(3):
            out, end = walk(cache, config(spec, 1.0, seed=seed), seed)
            assert end == 2 and ok(tok.decode(out)), (spec, tok.decode(out))


def test_json_object_allows_only_an_object_to_start(tok, cache):
    # A random walk through a free-form object need not end, so its first mask is checked.
    rows = GrammarRows(lambda: cache)
    rows.add(0, config(Spec("json_object")), [])
    allowed = torch.nonzero(allowed_tokens(rows.mask([0], [0], VOCAB))[0]).flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    assert tok.encode("{", add_special_tokens=False)[0] in allowed


def test_a_sequence_added_again_replays_to_the_same_mask(cache):
    cfg = config(Spec("json_schema", json.dumps(SCHEMAS[1])), 1.0, seed=4)
    out, _ = walk(cache, cfg, 4)
    first = GrammarRows(lambda: cache)
    first.add(3, cfg, [])
    again = GrammarRows(lambda: cache)
    cut = len(out) // 2
    first.accept(np.array([3] * cut), np.array(out[:cut]))
    again.add(3, cfg, out[:cut])  # e.g. recomputed after preemption, or on another worker
    assert torch.equal(first.mask([3], [0], VOCAB), again.mask([3], [0], VOCAB))
    assert allowed_tokens(again.mask([3], [0], VOCAB)).sum() < VOCAB  # a real constraint


def test_a_complete_answer_with_min_tokens_or_ignore_eos_is_a_conflict_not_a_sample(cache):
    sampler = Sampler(torch.Generator().manual_seed(0))
    for cfg, named in [(config(Spec("choice", choices=("ok",)), min_tokens=5), "min_tokens"),
                       (config(Spec("choice", choices=("ok",)), stop=()), "ignore_eos")]:
        rows = GrammarRows(lambda: cache)
        rows.add(0, cfg, [])
        out: list[int] = []
        for step in range(5):
            logits = torch.zeros(1, VOCAB)
            token = int(sampler(logits, [cfg], [step], [out], [0],
                                ([0], rows.mask([0], [0], VOCAB)))[0])
            if token < 0:
                break
            out.append(token)
            rows.accept(np.array([0]), np.array([token]))
        assert token == -1 and 0 < len(out) < 5
        assert named in why_no_token(cfg, len(out))


def allowed_tokens(bitmask: torch.Tensor) -> torch.Tensor:
    """The bitmask unpacked by hand (bit j of word w: token 32w + j), as bool [R, V]."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :VOCAB].bool()


def test_the_mask_forbids_exactly_what_the_bitmask_forbids_and_raw_logits_stay(cache):
    rows = GrammarRows(lambda: cache)
    cfg = config(Spec("json_schema", json.dumps(SCHEMAS[0])))
    rows.add(0, cfg, [])
    bitmask = rows.mask([0], [0], VOCAB)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    raw = logits.clone()
    masked = apply_grammar_mask(logits, [1], bitmask)
    assert torch.equal(logits, raw)  # logprobs read the raw logits
    assert torch.equal(masked[0], raw[0])  # an unconstrained row is untouched
    keep = allowed_tokens(bitmask)[0]
    assert torch.equal(masked[1][keep], raw[1][keep]) and torch.isneginf(masked[1][~keep]).all()


def test_the_offline_api_takes_vllms_structured_outputs_params():
    from pagoda import SamplingParams, StructuredOutputsParams
    from pagoda.params import generate_request
    req = generate_request({"prompt": "x"}, SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object"})))
    assert Spec.from_proto(req.sampling.structured_output) == Spec("json_schema", '{"type": "object"}')
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"]).to_proto()


def _grammar_spec(spec: Spec) -> internal_pb2.GrammarSpec:
    g = internal_pb2.GrammarSpec(key=spec.key())
    spec.to_proto(g.structured_output)
    return g


def test_compiling_happens_off_the_loop_and_is_answered_once_done(cache):
    """The worker's loop asks for compiles and polls; it never waits for one. The cache is
    built on the compile thread too (the real one loads the vocabulary for seconds): held here
    until the test lets it go, so nothing depends on timing."""
    import threading
    built = threading.Event()
    rows = GrammarRows(lambda: (built.wait(30), cache)[1])
    good, bad = Spec("regex", "[a-c]{2}"), Spec("regex", "(unclosed")
    rows.compile([_grammar_spec(good), _grammar_spec(bad), _grammar_spec(good)])
    assert rows.compiling and rows.finished() is None  # the loop goes on meanwhile
    built.set()
    answers = internal_pb2.GrammarsCompiled()
    for _ in range(300):
        if (msg := rows.finished()) is not None:
            answers.MergeFrom(msg)
        if not rows.compiling:
            break
        threading.Event().wait(0.05)
    assert list(answers.ready) == [good.key()]
    assert [f.key for f in answers.failed] == [bad.key()]
    with pytest.raises(SpecError) as refused:  # the compiler's own reason travels
        cache.get(bad)
    assert answers.failed[0].reason == str(refused.value)
    assert rows.finished() is None
    # A sequence of the compiled grammar is added with no compile on the loop: a cache hit.
    before = len(cache)
    rows.add(0, config(good, stop=()), [])
    assert 0 in rows.matchers and len(cache) == before


def test_warm_builds_the_cache_once_on_the_compile_thread_before_any_request(cache):
    """A worker warms at start (worker/main.py): the vocabulary loads off its loop, once, and the
    first compile then uses that cache instead of loading it again."""
    import threading
    import time
    built = []

    def make():
        built.append(threading.current_thread().name)
        return cache
    rows = GrammarRows(make)
    rows.warm().result(timeout=60)
    assert len(built) == 1 and built[0].startswith("grammar")
    spec = Spec("regex", "[a-z]{1,4}")
    rows.compile([internal_pb2.GrammarSpec(key=spec.key(), structured_output=config(spec).structured_output)])
    deadline = time.monotonic() + 60
    while (done := rows.finished()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done is not None and list(done.ready) == [spec.key()] and len(built) == 1


def test_a_row_past_its_stop_token_gets_a_mask_and_its_token_is_ignored(tok, cache):
    """The plan ahead was made before the scheduler saw the stop token: the next step still has
    the row. Its mask and its (thrown away) token must not fail the step, as xgrammar's refusal to
    fill a mask after a stop token did for every json_object answer that ended at EOS."""
    rows = GrammarRows(lambda: cache)
    rows.add(0, config(Spec("regex", "ab")), [])
    rows.add(1, config(Spec("regex", "[a-z]+")), [])
    a, b = (tok.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
    for token in (a, b, 2):  # "ab", then the stop token
        rows.accept(np.array([0]), np.array([token]))
    assert rows.matchers[0].is_terminated()
    mask = rows.mask([0, 1], [0, 1], VOCAB)  # row 1 still constrained, row 0 anything
    assert bool(allowed_tokens(mask)[0].all())
    assert not bool(allowed_tokens(mask)[1].all()) and bool(allowed_tokens(mask)[1][a])
    rows.accept(np.array([0, 1]), np.array([a, a]))
    assert rows.failed == {} and rows.matchers[0].is_terminated()


@pytest.mark.parametrize("kind, value, reason", [
    ("json_schema", '{"type": "integer", "minimum": -1e30}', "Integer exceeds minimum limit"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}',
     "Invalid structural tag error: Format type not recognized: nope"),
    ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "minLength 5 is greater than maxLength 2"),
    # a regex's error without the position in the grammar it was translated into
    ("regex", "a{5,2}", "Lower bound is larger than upper bound: 5 > 2"),
    ("json_schema", '{"type": "string", "pattern": "a{5,2}"}', "Lower bound is larger than upper bound: 5 > 2"),
    ("grammar", 'root ::= "a" x', 'EBNF parser error at line 1, column 14: Rule "x" is not defined'),
])
def test_a_refusal_gives_the_compilers_reason_without_its_internals(cache, kind, value, reason):
    """xgrammar words some refusals as a failed C++ assertion ("Check failed: (val >=
    MIN_INT64_AS_DOUBLE) is false: ..."), and some regex errors by their place in the grammar it
    translated the regex into; a client gets the reason alone (a grammar's own place stays)."""
    with pytest.raises(SpecError) as refused:
        cache.get(Spec(kind, value))
    assert str(refused.value) == reason


class _StuckCache:
    """A cache whose compile of a regex "slow..." runs until released (a spec the gateway let
    through but the worker compiles past its bound); others compile at once."""

    def __init__(self):
        import threading
        self.release = threading.Event()
        self.compiled: set[str] = set()

    def get(self, spec: Spec):
        if spec.value.startswith("slow"):
            self.release.wait(30)
        self.compiled.add(spec.key())

    def cached(self, spec: Spec) -> bool:
        return spec.key() in self.compiled


def _answers_until(rows: GrammarRows, wanted: int, timeout: float = 10.0) -> internal_pb2.GrammarsCompiled:
    import time
    answers, deadline = internal_pb2.GrammarsCompiled(), time.monotonic() + timeout
    while len(answers.ready) + len(answers.failed) < wanted and time.monotonic() < deadline:
        if (msg := rows.finished()) is not None:
            answers.MergeFrom(msg)
        time.sleep(0.01)
    return answers


def test_a_compile_past_the_workers_bound_fails_and_does_not_hold_up_the_others():
    """The gateway's check catches slow specs first; the worker's bound is the backstop. A
    compile past it is answered as failed with the reason, the grammars queued behind it compile
    at once on a fresh thread, and while too many abandoned compiles still run, a grammar the
    cache lacks is refused at once (a cached one is still ready)."""
    stuck = _StuckCache()
    rows = GrammarRows(lambda: stuck, timeout_s=0.3)
    try:
        slow, quick = Spec("regex", "slow1"), Spec("regex", "a+")
        rows.compile([_grammar_spec(slow), _grammar_spec(quick)])
        first = _answers_until(rows, 2)
        assert list(first.ready) == [quick.key()]
        assert [(f.key, f.reason) for f in first.failed] == [
            (slow.key(), "compiling it took longer than 0.3 s on the worker")]
        rows.compile([_grammar_spec(Spec("regex", "slow2"))])
        assert [f.reason for f in _answers_until(rows, 1).failed] == [
            "compiling it took longer than 0.3 s on the worker"]
        fresh, again = Spec("regex", "b+"), quick
        rows.compile([_grammar_spec(fresh), _grammar_spec(again)])
        third = _answers_until(rows, 2)
        assert list(third.ready) == [again.key()]
        assert [(f.key, f.reason) for f in third.failed] == [(fresh.key(), (
            "the worker's grammar compiler is still busy with 2 grammars that took longer than "
            "0.3 s; retry later"))]
        stuck.release.set()  # the slow ones end: compiling goes on as before
        import time
        deadline = time.monotonic() + 5
        while any(not f.done() for f in rows._abandoned) and time.monotonic() < deadline:
            time.sleep(0.01)
        rows.compile([_grammar_spec(fresh)])
        assert list(_answers_until(rows, 1).ready) == [fresh.key()] and not rows.compiling
    finally:
        stuck.release.set()


def test_the_compiled_grammar_cache_is_bounded_in_bytes(cache):
    """One long bounded repetition compiles to megabytes: the cache keeps what fits its bytes,
    least recently used first out, however few the entries."""
    from structured.compiler import GrammarCache
    big = [Spec("regex", f"[a-z]{{1,{2000 + i}}}") for i in range(3)]
    size = cache.get(big[0]).memory_size_bytes
    assert size > 1 << 20  # megabytes each: entries alone would bound nothing
    small = GrammarCache(cache.info, max_entries=100, max_bytes=int(2.5 * size))
    for spec in big:
        small.get(spec)
    assert [small.cached(s) for s in big] == [False, True, True]
    assert len(small) == 2 and small.bytes <= int(2.5 * size)


def test_the_lru_keeps_bytes_and_entries_within_their_bounds():
    from structured.lru import BytesLru
    lru = BytesLru(max_bytes=100, max_entries=3)
    for key, size in (("a", 40), ("b", 40), ("c", 10)):
        lru.put(key, key.upper(), size)
    assert lru.get("a") == "A"  # now the most recent: b goes first
    lru.put("d", "D", 30)
    assert [k for k in "abcd" if k in lru] == ["a", "c", "d"] and lru.bytes == 80
    lru.put("e", "E", 1)  # a fourth entry: the least recent (c) goes
    assert [k for k in "acde" if k in lru] == ["a", "d", "e"]
    lru.put("huge", "H", 101)  # larger than the whole bound: not kept, nothing evicted
    assert "huge" not in lru and len(lru) == 3 and lru.bytes == 71
