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


def transformers_figures(prompts: list[str], max_tokens: int, dtype: str) -> tuple[float, float]:
    """The peer in the same run: transformers `generate` on the same model, greedy, one prompt
    alone and then all prompts as one padded static batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launch.models import resolve_model
    path = resolve_model("")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=getattr(torch, dtype)).eval()
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]

    def run(batch: list[str]) -> float:
        enc = tok(batch, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch) / (time.perf_counter() - t0)

    run(texts[:1])  # warm-up
    return run(texts[:1]), run(texts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--compare-dtype", default=None,
                    help="also run transformers generate in this dtype (float32 or bfloat16)")
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
    prompts = [PROMPTS[0]] + [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(1, opts.concurrency)]
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.processor() or platform.platform()}")
    print(f"flags: {' '.join(extra) or '(defaults)'}")
    print(f"launch to first token (cold processes, warm file cache): {startup:.1f} s")
    print(f"1 stream: {n1 / dt1:.1f} tok/s, time to first token {ttft1 * 1000:.0f} ms")
    print(f"{opts.concurrency} streams: {total / dtn:.1f} tok/s aggregate, "
          f"{total / dtn / opts.concurrency:.1f} tok/s per stream, "
          f"mean TTFT {sum(r[1] for r in results) / len(results) * 1000:.0f} ms")
    if opts.compare_dtype:
        hf1, hfn = transformers_figures(prompts, opts.max_tokens, opts.compare_dtype)
        print(f"transformers generate ({opts.compare_dtype}): 1 stream {hf1:.1f} tok/s, "
              f"static batch of {opts.concurrency}: {hfn:.1f} tok/s")
        print(f"ratio pagoda/transformers: 1 stream {n1 / dt1 / hf1:.2f}x, "
              f"{opts.concurrency} streams {total / dtn / hfn:.2f}x")


if __name__ == "__main__":
    main()
