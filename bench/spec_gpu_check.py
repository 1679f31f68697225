"""Speculative decoding and fp32 logits on CUDA, in process: the real scheduler (scheduler.Router)
feeding the real worker (worker.runner.ModelRunner), no sockets. bench/gpu_check.sh runs it.

    python -m bench.spec_gpu_check [--device cuda] [--layers 4] [--requests 12] [--max-tokens 48]
    python -m bench.spec_gpu_check --device cpu --layers 1 --vocab 2048 --requests 4   # a dry run

The model is random (bench/random_model.py) with SmolLM2-135M's attention (9 query heads, 3 KV
heads, head_dim 64, blocks of 16) and fewer layers. GQA 3 matters: verification queries of up to
5 rows take the Triton kernel's narrow decode tiles (and split-KV), longer ones its prefill tiles.

1. fp32, greedy: the same requests without speculation, then with ngram (k=4), suffix (k=16) and
   draft_model with the target as its own draft (k=4 and k=16: nearly every proposal is accepted,
   so each step verifies k + 1 rows and keeps them all), on short prompts and on two long ones
   (few sequences over long contexts: split-KV). Tokens must be identical. A divergence where
   the plain run's top two logits are within NEAR_TIE is reported as a tie, not failed: 1-row
   and k-row fp32 products differ in rounding (~1e-6).
2. fp32 logits of this device's worker against the CPU worker's (the torch/C path) on prefills in
   chunks and a few decode steps: max abs difference <= LOGITS_TOL.
3. bf16 (the CUDA default), the same runs: reported (identical requests, first divergences and
   their margins); only step errors and wrong lengths fail, bf16 rounding differs by row count.
Exit status: the number of failed checks. Every line is flushed as it is printed, so a run cut by
a timeout still shows the phases it finished.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch

from bench.random_model import write_random_model
from proto import internal_pb2 as pb
from proto.columns import unpack
from proto.token_stream import updates
from scheduler.router import Router, RouterConfig
from tests.plan_driver import PlanDriver
from worker.runner import ModelRunner
from worker.speculation.speculator import build_speculator
from worker.worker_flags import worker_args

NEAR_TIE = 1e-3       # logits; fp32 rounding between row counts is ~1e-5 at this model's scale
LOGITS_TOL = 1e-4     # CUDA fp32 against the CPU worker (the test suite's bound against HF)
BATCH_TOKENS = 4096
ACTIVE_TOKENS = 32    # the tokens greedy answers use (bench/random_model.py): answers repeat
START = time.perf_counter()


def say(*parts) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s]", *parts, flush=True)


def methods(model: Path) -> dict[str, dict | None]:
    """disable_by_batch_size 0: every sequence of a batch speculates, however many."""
    return {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0},
            "suffix": {"method": "suffix", "disable_by_batch_size": 0},       # k = 16
            # The target as its own draft: every proposal accepted but at near-ties, so each step
            # verifies k + 1 rows: 5 (the decode tiles) and 17 (the prefill tiles).
            "draft4": {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4,
                       "disable_by_batch_size": 0},
            "draft16": {"method": "draft_model", "model": str(model), "num_speculative_tokens": 16,
                        "disable_by_batch_size": 0}}


def workloads(n: int, max_tokens: int) -> dict[str, tuple[list[list[int]], int]]:
    """Short prompts (random; a span repeated; a short cycle, which the proposers match long)
    and two long ones of repeated spans (2 sequences over thousands of keys: split-KV), all of
    the model's ACTIVE_TOKENS."""
    rng = random.Random(0)

    def tokens(k):
        return [rng.randrange(ACTIVE_TOKENS) for _ in range(k)]

    short = []
    for i in range(n):
        if i % 3 == 0:
            short.append(tokens(rng.randint(16, 200)))
        elif i % 3 == 1:
            span = tokens(rng.randint(8, 40))
            short.append(span * rng.randint(2, 5) + span[:rng.randint(0, len(span) - 1)])
        else:
            short.append(tokens(rng.randint(3, 6)) * rng.randint(6, 20))
    long = []
    for length in (1500, 2600):
        span, p = tokens(300), []
        while len(p) < length:
            p += span + tokens(rng.randint(1, 20))
        long.append(p[:length])
    return {"short": (short, max_tokens), "long": (long, max(8, max_tokens * 2 // 3))}


def make_runner(model: Path, device: str, dtype: str) -> ModelRunner:
    return ModelRunner(worker_args([
        "--model", str(model), "--device", device, "--dtype", dtype, "--max-model-len", "4096",
        "--num-gpu-blocks-override", "1024", "--max-num-batched-tokens", str(BATCH_TOKENS),
        "--max-num-seqs", "64"]))


def generate(runner: ModelRunner, speculator, prompts, max_tokens):
    """Every request through the Router to its end: (tokens by request, step errors, stats)."""
    runner.speculator = runner.speculation.speculator = speculator  # the hello's and the step's
    runner.forget_all()
    router = Router(RouterConfig(max_num_seqs=64, max_num_batched_tokens=BATCH_TOKENS,
                                 max_waiting_requests=len(prompts) + 1))
    router.register(b"w", runner.hello())
    for i, p in enumerate(prompts):
        router.add(b"gw", pb.AddRequest(request_id=f"r{i}", prompt_token_ids=p, max_tokens=max_tokens,
                                        ignore_eos=True, sampling=pb.SamplingConfig()))
    out = {f"r{i}": [] for i in range(len(prompts))}
    errors, stats = [], {"steps": 0, "drafts": 0, "accepted": 0, "widest": 1}
    scheduler = router.workers[b"w"].scheduler
    while scheduler.has_work and stats["steps"] < 20000:
        sent = router.plans()
        for wid, plan in sent:
            result = runner.execute(plan)
            if result.error:
                errors.append(result.error)
            if result.num_drafts:    # set when rows speculated: a row's run is accepted + 1
                drafts, runs = unpack(result.num_drafts), unpack(result.num_tokens)
                stats["drafts"] += int(drafts.sum())
                stats["accepted"] += int(runs.sum()) - len(runs)
                stats["widest"] = max(stats["widest"], 1 + int(drafts.max()))
            stats["steps"] += 1
            router.on_result(wid, result)
        for msg in router.take_outbox().values():
            for u in updates(msg):
                out[u.request_id] += u.token_ids
                if u.news is not None and u.news.HasField("error"):
                    errors.append(f"{u.request_id}: {u.news.error.message}")
        if not sent:
            break
    errors += [f"{r}: {len(t)} tokens, not {max_tokens}" for r, t in out.items() if len(t) != max_tokens]
    return out, errors, stats


def top2(runner: ModelRunner, prompt: list[int]) -> tuple[list[int], float]:
    """The two best next tokens after `prompt` and their logit gap (a plain prefill)."""
    runner.speculator = runner.speculation.speculator = None
    runner.forget_all()
    original = runner.model.compute_logits
    try:
        seq = PlanDriver(runner, token_budget=BATCH_TOKENS).generate([prompt], 1)[0]
    finally:
        runner.model.compute_logits = original       # PlanDriver wraps it to capture the logits
        runner.forget_all()
    best = torch.topk(seq.logits[0].float(), 2)
    return best.indices.tolist(), float(best.values[0] - best.values[1])


def compare(runner, name, prompts, plain, got, strict: bool) -> tuple[int, list[str]]:
    """Identical requests, and the failures: a divergence off a near-tie (strict), or none."""
    same, failures = 0, []
    for i, p in enumerate(prompts):
        a, b = plain[f"r{i}"], got[f"r{i}"]
        if a == b:
            same += 1
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ids, gap = top2(runner, p + a[:at])
        tie = gap < NEAR_TIE and b[at:at + 1] == ids[1:2]
        say(f"    r{i} ({len(p)} prompt tokens): first divergence at output {at}: plain {a[at:at + 3]}, "
            f"{name} {b[at:at + 3]}; plain's top two {ids}, gap {gap:.2e}{' (a near-tie)' if tie else ''}")
        if strict and not tie:
            failures.append(f"{name}: r{i} diverges at output {at} (gap {gap:.2e}, not a near-tie)")
    return same, failures


def run_dtype(runner, model, loads, strict: bool) -> list[str]:
    failures = []
    speculators = {}
    for load, (prompts, max_tokens) in loads.items():
        plain = None
        for name, spec in methods(model).items():
            if name not in speculators:
                speculators[name] = build_speculator(json.dumps(spec) if spec else None, runner)
                if speculators[name] is not None:
                    speculators[name].allocate_draft_cache(runner.cache.num_blocks, runner.block_size)
            t0 = time.perf_counter()
            out, errors, st = generate(runner, speculators[name], prompts, max_tokens)
            line = (f"  {load:5} {name:7}: {len(prompts)} requests x {max_tokens} tokens in {st['steps']} "
                    f"steps, {time.perf_counter() - t0:.1f}s; drafts {st['drafts']}, accepted "
                    f"{st['accepted']}, widest verification {st['widest']} rows")
            failures += [f"{load} {name}: {e}" for e in errors[:5]]
            tail = f"; ERRORS {errors[:3]}" if errors else ""
            if plain is None:
                plain = out
                say(line + tail)
                continue
            same, bad = compare(runner, name, prompts, plain, out, strict)
            failures += [f"{load} {e}" for e in bad]
            say(line + f"; identical to plain: {same}/{len(prompts)}" + tail)
            if st["drafts"] == 0:
                say(f"    note: {name} proposed nothing on {load}: its verification path did not run")
    return failures


def logits_against_cpu(runner, model: Path, vocab: int) -> list[str]:
    """Prefills in chunks of 96 tokens a step (shared by the sequences), then 5 decode steps."""
    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (40, 130, 300)]
    cpu = make_runner(model, "cpu", "float32")
    seqs = {}
    for label, r in (("device", runner), ("cpu", cpu)):
        r.speculator = None
        r.forget_all()
        original = r.model.compute_logits
        try:
            seqs[label] = PlanDriver(r, token_budget=96).generate(prompts, 6)
        finally:
            r.model.compute_logits = original
    worst, failures = 0.0, []
    for i, (a, b) in enumerate(zip(seqs["device"], seqs["cpu"])):
        for step, (x, y) in enumerate(zip(a.logits, b.logits)):
            err = (x.double().cpu() - y.double()).abs().max().item()
            worst = max(worst, err)
            if err > LOGITS_TOL:
                failures.append(f"logits: seq {i} step {step}: max abs diff {err:.2e} > {LOGITS_TOL}")
        if a.output != b.output:
            say(f"    seq {i}: tokens differ (device {a.output}, cpu {b.output})")
    scale = max(x.abs().max().item() for s in seqs["cpu"] for x in s.logits)
    say(f"  fp32 logits, {runner.device} against cpu: max abs diff {worst:.2e} over 3 sequences x 6 "
        f"steps (logits up to {scale:.1f}; bound {LOGITS_TOL})")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip", default="", help="phases to leave out, e.g. bf16,cpu")
    opts = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    skip = set(filter(None, opts.skip.split(",")))
    if opts.device == "cuda":
        # fp32 must be fp32: no TF32 in cuBLAS (the NGC images' override env var would force it).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; TF32 override env: "
            f"{os.environ.get('TORCH_ALLOW_TF32_CUBLAS_OVERRIDE', 'unset')}")
    model = write_random_model(f"/tmp/pagoda-spec-check-{opts.layers}-{opts.vocab}", scale=0.08,
                               active_tokens=ACTIVE_TOKENS, num_layers=opts.layers,
                               vocab_size=opts.vocab)
    say(f"model: {opts.layers} layers of SmolLM2-135M's shape, vocab {opts.vocab}, in {model}")
    loads = workloads(opts.requests, opts.max_tokens)
    failures = []

    say("1. fp32: greedy tokens with each speculation method against none")
    runner = make_runner(model, opts.device, "float32")
    failures += run_dtype(runner, model, loads, strict=True)
    if "cpu" not in skip:
        say(f"2. fp32 logits: {opts.device} worker against the cpu worker")
        failures += logits_against_cpu(runner, model, opts.vocab)
    del runner
    if opts.device == "cuda" and "bf16" not in skip:
        torch.cuda.empty_cache()
        say("3. bf16: the same runs (reported; only errors and lengths fail)")
        failures += run_dtype(make_runner(model, opts.device, "bfloat16"), model, loads, strict=False)
    for f in failures:
        say("FAIL", f)
    say(f"spec_gpu_check: {'PASS' if not failures else f'{len(failures)} failure(s)'}")
    return min(len(failures), 100)


if __name__ == "__main__":
    sys.exit(main())
