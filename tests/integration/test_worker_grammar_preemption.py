"""Structured outputs under preemption, with the real model and xgrammar: the real Router and
ModelRunner in one process, the compile handshake as the worker's loop runs it. With so few KV
blocks that the constrained requests preempt each other (by recompute, and by swap), every
matcher stays where its output says: each greedy answer is token-identical to the one of a run
with blocks to spare, and validates against its schema (jsonschema)."""
from __future__ import annotations

import argparse
import json
import time

import jsonschema
import pytest

from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as pb, pagoda_pb2
from proto.token_stream import updates
from scheduler.router import Router, RouterConfig
from worker.runner import ModelRunner
from worker.worker_flags import add_worker_args

pytestmark = pytest.mark.integration

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 2}},
     "required": ["colour", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "rain": {"type": "boolean"}},
     "required": ["city", "rain"], "additionalProperties": False},
]
MAX_TOKENS = 80


def serve(runner: ModelRunner, prompts, schemas, num_blocks: int | None = None,
          swap: bool = False) -> tuple[dict[str, list[int]], dict]:
    """num_blocks: what the scheduler is told the worker has (the worker keeps more: the
    scheduler names only blocks below it); swap: whether it may use the worker's swap space."""
    router = Router(RouterConfig(max_num_seqs=16, max_num_batched_tokens=256))
    hello = runner.hello()
    hello.num_blocks = num_blocks or hello.num_blocks
    hello.num_cpu_blocks = hello.num_cpu_blocks if swap else 0
    router.register(b"w", hello)
    for i, (prompt, schema) in enumerate(zip(prompts, schemas)):
        sampling = pb.SamplingConfig()
        sampling.structured_output.CopyFrom(pagoda_pb2.StructuredOutput(json_schema=json.dumps(schema)))
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                        max_tokens=MAX_TOKENS, sampling=sampling))
    for _, msg in router.grammar_requests():
        runner.compile_grammars(msg)
    while runner.compiling:
        if (done := runner.grammars_finished()) is not None:
            router.on_compiled(b"w", done)
        time.sleep(0.002)  # as the worker's loop polls: the compile thread needs the GIL too
    if (done := runner.grammars_finished()) is not None:
        router.on_compiled(b"w", done)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    sched = router.workers[b"w"].scheduler
    while sched.has_work:
        for wid, plan in router.plans():
            result = runner.execute(plan)
            assert not result.error and not result.failed, (result.error, result.failed)
            router.on_result(wid, result)
        for msg in router.take_outbox().values():
            for u in updates(msg):
                assert u.news is None or not u.news.error.code, u.news
                tokens[u.request_id] += u.token_ids
    return tokens, dict(sched.stats.num_preemptions)


def test_constrained_answers_survive_preemption_by_recompute_and_swap():
    tok = load_tokenizer("")
    runner = ModelRunner(add_worker_args(argparse.ArgumentParser()).parse_args(
        ["--dtype", "float32", "--max-num-batched-tokens", "256", "--block-size", "16",
         "--swap-space", "0.05"]))
    schemas = [SCHEMAS[i % 3] for i in range(6)]
    prompts = [tok.encode_chat([{"role": "user", "content": f"Give example {i} as JSON with the "
                                 f"fields {' and '.join(s['required'])}."}])
               for i, s in enumerate(schemas)]
    roomy, none = serve(runner, prompts, schemas)
    assert none == {"recompute": 0, "swap": 0}
    for i, schema in enumerate(schemas):
        ids = roomy[f"r{i}"]
        assert ids[-1] in tok.eos_token_ids, tok.decode(ids)  # each ended by its grammar
        jsonschema.validate(json.loads(tok.decode(ids)), schema)
    # Six answers of 43 prompt and about 15 output tokens (4 blocks each): 14 blocks hold three.
    for swap, mode in ((False, "recompute"), (True, "swap")):
        tight, preemptions = serve(runner, prompts, schemas, num_blocks=14, swap=swap)
        assert preemptions[mode] > 0, preemptions
        assert tight == roomy, mode
