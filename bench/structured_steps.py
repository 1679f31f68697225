"""What structured outputs cost a step: 64 concurrent requests, each with its own JSON schema,
against the same 64 prompts unconstrained, through the real Router and ModelRunner in one process
(no sockets; the compile handshake as the worker's loop runs it). Answers end at different
lengths, so decode steps are compared at equal batch size, not requests.

Reported: compile time per schema, cold (the worker's compile thread, vocabulary load apart) and
cached; the per-step grammar cost (masks filled, applied, tokens accepted) per constrained row;
and the decode step time, constrained vs unconstrained, at each batch size both runs had. Every
constrained answer that ended by itself is checked against its schema (jsonschema).

    .venv/bin/python -m bench.structured_steps [--requests 64] [--threads 2] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jsonschema
import torch

from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as pb, pagoda_pb2
from proto.columns import unpack
from proto.token_stream import updates
from scheduler.router import Router, RouterConfig
from worker.grammar import matchers as worker_grammar
from worker.runner import ModelRunner
from worker.worker_flags import add_worker_args

COLOURS = ["red", "green", "blue", "black", "white", "amber", "teal", "plum"]
FIELDS = ["name", "city", "title", "brand", "owner", "topic", "label", "place"]


def schema(i: int) -> dict:
    """Schema i of a family of distinct ones: strings, a bounded integer, an enum, an array,
    an optional field, all bounded so that a small model finishes."""
    a, b = FIELDS[i % 8], FIELDS[(i // 8 + 3) % 8]
    props = {a: {"type": "string", "maxLength": 6 + i % 5},
             f"{b}_id": {"type": "integer", "minimum": 0, "maximum": 100 + i},
             "colour": {"enum": COLOURS[i % 5:i % 5 + 3]},
             "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                      "maxItems": 1 + i % 3}}
    if i % 2:
        props["note"] = {"type": "string", "maxLength": 8}
    return {"type": "object", "properties": props, "required": [a, f"{b}_id", "colour"],
            "additionalProperties": False}


class Timed:
    """Wall time spent in the worker's grammar calls of each step, and the rows they served."""

    def __init__(self) -> None:
        self.seconds, self.rows = 0.0, 0
        rows_cls = worker_grammar.GrammarRows
        for name in ("mask", "accept"):
            setattr(rows_cls, name, self._wrap(getattr(rows_cls, name), name))
        worker_grammar.apply_grammar_mask = self._wrap(worker_grammar.apply_grammar_mask, "")
        import worker.runner
        worker.runner.apply_grammar_mask = worker_grammar.apply_grammar_mask

    def _wrap(self, fn, name):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t
                if name == "mask":
                    self.rows += len(args[2])
        return timed


def run(runner, router, prompts, schemas, max_tokens):
    """Serve the requests; returns (decode step times by batch size, texts by request, compile
    seconds until every grammar was ready)."""
    for i, prompt in enumerate(prompts):
        sampling = pb.SamplingConfig()
        if schemas:
            sampling.structured_output.CopyFrom(pagoda_pb2.StructuredOutput(json_schema=json.dumps(schemas[i])))
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        max_tokens=max_tokens, ignore_eos=not schemas,
                                        sampling=sampling))
    started, compile_s = time.perf_counter(), 0.0
    for _, msg in router.grammar_requests():
        runner.compile_grammars(msg)
    while runner.compiling:
        if (done := runner.grammars_finished()) is not None:
            router.on_compiled(b"w", done)
        time.sleep(0.001)
    if (done := runner.grammars_finished()) is not None:
        router.on_compiled(b"w", done)
    compile_s = time.perf_counter() - started
    steps = collections.defaultdict(list)
    tokens = collections.defaultdict(list)
    while router.workers[b"w"].scheduler.has_work:
        for wid, plan in router.plans():
            counts = list(unpack(plan.running_num_tokens)) + [s.num_new_tokens for s in plan.new_seqs]
            t = time.perf_counter()
            result = runner.execute(plan)
            elapsed = time.perf_counter() - t
            assert not result.error and not result.failed, (result.error, result.failed)
            if counts and sum(counts) == len(counts):  # decode only (not a step that only drops)
                steps[len(counts)].append(elapsed)
            router.on_result(wid, result)
        for msg in router.take_outbox().values():
            for u in updates(msg):
                tokens[u.request_id] += u.token_ids
    return steps, tokens, compile_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    tok = load_tokenizer("")
    schemas = [schema(i) for i in range(opts.requests)]
    prompts = [tok.encode_chat([{"role": "user", "content": f"Describe item {i} as JSON with the "
                                 f"fields {', '.join(s['required'])}."}]) for i, s in enumerate(schemas)]
    runner = ModelRunner(add_worker_args(argparse.ArgumentParser()).parse_args(
        ["--dtype", "float32", "--max-num-batched-tokens", "2048"]))
    timed = Timed()

    def router():
        r = Router(RouterConfig(max_num_seqs=256, max_num_batched_tokens=2048,
                                max_waiting_requests=opts.requests + 1))
        r.register(b"w", runner.hello())
        return r

    t = time.perf_counter()
    runner.grammar.cache  # the vocabulary, once per worker: apart from the compiles
    vocab_s = time.perf_counter() - t
    plain, _, _ = run(runner, router(), prompts, [], opts.max_tokens)
    timed.seconds = timed.rows = 0
    constrained, texts, cold_s = run(runner, router(), prompts, schemas, opts.max_tokens)
    grammar_s, grammar_rows = timed.seconds, timed.rows
    t = time.perf_counter()
    for s in schemas:  # cached: what a repeat of each schema costs
        runner.grammar.cache.get(__import__("structured.spec", fromlist=["Spec"]).Spec(
            "json_schema", json.dumps(s)))
    cached_s = (time.perf_counter() - t) / len(schemas)

    valid = ended = 0
    for i, s in enumerate(schemas):
        ids = texts[f"r{i}"]
        if ids and ids[-1] in tok.eos_token_ids:
            ended += 1
            jsonschema.validate(json.loads(tok.decode(ids)), s)
            valid += 1
    print(f"{opts.requests} schemas: vocabulary {vocab_s:.2f} s once; compile cold "
          f"{1e3 * cold_s / len(schemas):.1f} ms per schema (all {cold_s:.2f} s on one thread), "
          f"cached {1e3 * cached_s:.3f} ms")
    print(f"answers: {ended} ended by their grammar, {valid} of them valid (jsonschema)")
    print(f"grammar work per constrained row and step: {1e3 * grammar_s / max(1, grammar_rows):.3f} ms "
          f"({grammar_rows} rows)")
    print(f"{'batch':>5} {'plain ms':>9} {'constrained ms':>15} {'cost':>7}  steps")
    both = sorted(set(plain) & set(constrained), reverse=True)
    ratios = []
    for b in both:
        p, c = statistics.median(plain[b]), statistics.median(constrained[b])
        ratios.append(c / p)
        print(f"{b:5d} {1e3 * p:9.1f} {1e3 * c:15.1f} {100 * (c / p - 1):+6.1f}%  {len(plain[b])}/{len(constrained[b])}")
    if ratios:
        print(f"median over batch sizes: {100 * (statistics.median(ratios) - 1):+.1f}%")


if __name__ == "__main__":
    main()
