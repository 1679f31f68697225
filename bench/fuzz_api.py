"""Bad input against the real model: every HTTP operation of the gateway's OpenAPI document
fuzzed with schemathesis (tests/http_fuzz.py) and every RPC of pagoda.proto with
hypothesis-drawn messages (tests/grpc_fuzz.py), thousands of examples each, as
tests/faults/test_fuzz_api.py does with 50 on the fake worker. Reports per operation the
examples sent, the statuses, the fields refused most, and each failure: a 5xx, an answer the
document does not describe, a request it calls invalid that was taken, an INTERNAL or UNKNOWN
status, a call past its deadline; then whether the gateway still serves, and the stack's log
lines no input should cause (an error, a traceback, a process dropping another's message).

    .venv/bin/python -m bench.fuzz_api [--examples 2000] [--seed 53] [--only chat,Generate]
        [--huge 4194304] [--deadline 300] [--max-tokens 16] [--json out.json]

starts the real stack (launcher, SmolLM2, fp32) with an API key, --max-model-len 64 so that an
answer is short (a chat of one short message, 31 tokens with SmolLM2's system prompt, still
fits) and one OpenMP thread in each process (--threads; on a machine other processes keep busy,
the worker's two threads met at every layer's barrier and a step waited for the one that was
descheduled: 1 token a second against 14 with one thread on 2 shared cores); or point it at a
running one (its key, if it has one):

    .venv/bin/python -m bench.fuzz_api --http http://127.0.0.1:8000 --grpc 127.0.0.1:50051 \\
        [--key KEY] [--log ITS_LOG]

The same seed sends the same requests. Exits 1 when anything failed."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.rest.openapi import OPERATIONS
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests import grpc_fuzz, http_fuzz
from tests.cluster import Cluster
from tests.proto_strategies import Sizes

KEY = "fuzz-bench-key"


def healthy(http: str, target: str, key: str | None) -> dict:
    """Health over both APIs, and one small generation answered."""
    with urllib.request.urlopen(f"{http}/health", timeout=10) as r:
        http_health = r.status
    with grpc.insecure_channel(target) as channel:
        grpc_health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10).status
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        started = time.monotonic()
        answer = pagoda_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            prompt="Hello", stopping=pb.StoppingCriteria(max_tokens=4)), metadata=metadata,
            timeout=60)
    return {"http_health": http_health, "grpc_serving": grpc_health == health_pb2.HealthCheckResponse.SERVING,
            "generate_tokens": len(answer.token_ids), "generate_s": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2000, help="per operation and per RPC")
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--only", default="", help="comma-separated parts of paths or RPC names")
    p.add_argument("--huge", type=int, default=1 << 22,
                   help="the longest string or list drawn (characters or entries)")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds, each call (a whole answer of max_model_len tokens on a busy CPU)")
    p.add_argument("--http", help="a running gateway's HTTP root (else the stack is started)")
    p.add_argument("--grpc", help="its gRPC target, host:port")
    p.add_argument("--key", help="its API key, if it has one")
    p.add_argument("--log", type=Path, help="its log, read as the started stack's is")
    p.add_argument("--max-model-len", type=int, default=64, help="of the stack started here")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the stack started here (its worker's kernels)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="the most tokens asked of the RPCs' requests steered past the first checks")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    only = [o for o in args.only.split(",") if o]
    chosen = lambda name: not only or any(o in name for o in only)  # noqa: E731

    cluster = None
    if args.http:
        http, target, key = args.http.rstrip("/"), args.grpc, args.key
    else:
        log = args.log = Path(tempfile.mkdtemp(prefix="fuzz-api-")) / "stack.log"
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the launcher's children inherit it
        cluster = Cluster("--dtype", "float32", "--api-key", KEY,
                          "--max-model-len", str(args.max_model_len), log_path=log,
                          lazy_grammar=False).start(timeout=1200)  # minutes on a busy machine
        http, target, key = f"http://127.0.0.1:{cluster.http_port}", cluster.target, KEY
        print(f"stack started, log {log}", flush=True)
    reports, failed = [], 0
    try:
        with grpc.insecure_channel(target) as channel:
            model = pagoda_pb2_grpc.GenerationStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {key}"),) if key
                else (), timeout=30)
            document = http_fuzz.load(http)
            for path, method in sorted(OPERATIONS):
                if chosen(path):
                    r = http_fuzz.fuzz(document, path, method, http, key or "", model.model,
                                       args.examples, args.seed, timeout=args.deadline)
                    reports.append(_show(r.operation, r.examples, r.statuses, r.refusals,
                                         r.failures, r.seconds, r.messages))
                    _write(args, reports)
            for rpc in grpc_fuzz.RPCS:
                if chosen(rpc):
                    r = grpc_fuzz.fuzz(channel, rpc, key or "", args.examples, args.seed,
                                       Sizes(huge=args.huge), vocab_size=model.vocab_size,
                                       max_tokens=args.max_tokens, timeout=args.deadline)
                    reports.append(_show(rpc, r.examples, r.statuses, r.refusals, r.failures,
                                         r.seconds, r.details))
                    _write(args, reports)
        after = healthy(http, target, key)
        alive = cluster is None or cluster.proc.poll() is None
        logged = _logged_faults(args.log.read_text(errors="replace")) if args.log else []
        print(f"after: {after}, launcher alive: {alive}, faults in the log: {len(logged)}", flush=True)
        for line in logged[:20]:
            print("    " + line[:500], flush=True)
        failed = sum(len(r["failures"]) for r in reports) + (not alive) + (after["http_health"] != 200) \
            + (not after["grpc_serving"]) + len(logged)
        _write(args, reports, after=after, alive=alive, logged=logged[:100])
    finally:
        if cluster is not None:
            cluster.stop()
    return 1 if failed else 0


def _logged_faults(log: str) -> list[str]:
    """The stack's lines that no input should cause: an error, a traceback, or one process
    dropping another's message (the sender let through what the receiver's checks refuse)."""
    return [line for line in log.splitlines()
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
            or (" WARNING " in line and "dropped a" in line)]


def _write(args, reports: list[dict], **end) -> None:
    """After each operation, so that a run cut short keeps what it did."""
    if args.json:
        args.json.write_text(json.dumps({"examples": args.examples, "seed": args.seed,
                                         "huge": args.huge, "operations": reports, **end},
                                        indent=1))


def _show(name: str, examples: int, statuses, refusals, failures: list[str], seconds: float,
          samples: dict) -> dict:
    """samples: a message for each field refused (HTTP) or each status (gRPC)."""
    kinds: dict[str, int] = {}
    for f in failures:
        kinds[f.split("\n", 1)[0]] = kinds.get(f.split("\n", 1)[0], 0) + 1
    print(f"{name}: {examples} examples in {seconds:.0f} s, statuses "
          f"{dict(sorted(statuses.items(), key=lambda kv: str(kv[0])))}, failures {kinds or 'none'}; "
          f"refused most: {dict(refusals.most_common(6))}", flush=True)
    for kind in kinds:
        first = next(f for f in failures if f.startswith(kind))
        print("    " + first[:1500].replace("\n", "\n    "), flush=True)
    return {"operation": name, "examples": examples, "seconds": round(seconds, 1),
            "statuses": {str(k): v for k, v in statuses.items()}, "failure_kinds": kinds,
            "failures": failures[:20], "refused_most": dict(refusals.most_common(10)),
            "samples": samples}


if __name__ == "__main__":
    sys.exit(main())
