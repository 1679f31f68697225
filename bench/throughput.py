"""End-to-end figures for docs/benchmarks.md: start-up to first token, tokens/s for 1 and for 16
concurrent streams, over real gRPC against the processes `make run` starts.

    .venv/bin/python bench/throughput.py [--dtype auto] [--max-tokens 128] [extra pagoda flags]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc  # noqa: E402
from tests.cluster import Cluster  # noqa: E402

PROMPTS = ["Tell me about the history of Rome.", "Explain how a rainbow forms.",
           "Write a short story about a robot.", "Describe the water cycle.",
           "What are the benefits of exercise?", "Explain photosynthesis simply.",
           "Describe a day at the beach.", "How do airplanes fly?"]


def stream(stub, prompt: str, max_tokens: int) -> tuple[int, float, float]:
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                             sampling=pb.SamplingParams(temperature=0),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    t0, first, n = time.perf_counter(), None, 0
    for msg in stub.GenerateStream(req, timeout=600):
        if msg.token_ids and first is None:
            first = time.perf_counter() - t0
        n += len(msg.token_ids)
    return n, first or 0.0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    opts, extra = ap.parse_known_args()
    t_start = time.perf_counter()
    cluster = Cluster(*extra, log_path=Path("/tmp/pagoda-bench.log")).start(timeout=600)
    try:
        with grpc.insecure_channel(cluster.target) as ch:
            stub = pagoda_pb2_grpc.GenerationStub(ch)
            n, ttft, _ = stream(stub, "Hello!", 1)
            startup = time.perf_counter() - t_start
            stream(stub, PROMPTS[0], 8)  # warm-up
            n1, ttft1, dt1 = stream(stub, PROMPTS[0], opts.max_tokens)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(opts.concurrency) as pool:
                results = list(pool.map(lambda i: stream(stub, PROMPTS[i % len(PROMPTS)] + f" ({i})",
                                                         opts.max_tokens), range(opts.concurrency)))
            dtn = time.perf_counter() - t0
    finally:
        cluster.stop()
    total = sum(r[0] for r in results)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.processor() or platform.platform()}")
    print(f"flags: {' '.join(extra) or '(defaults)'}")
    print(f"launch to first token (cold processes, warm file cache): {startup:.1f} s")
    print(f"1 stream: {n1 / dt1:.1f} tok/s, time to first token {ttft1 * 1000:.0f} ms")
    print(f"{opts.concurrency} streams: {total / dtn:.1f} tok/s aggregate, "
          f"{total / dtn / opts.concurrency:.1f} tok/s per stream, "
          f"mean TTFT {sum(r[1] for r in results) / len(results) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
