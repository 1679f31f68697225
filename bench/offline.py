"""Offline throughput: one workload, all requests known up front, through three peers one after
another in one command, on the same model (SmolLM2-135M-Instruct from the GGUF), the same dtype
and the same prompt token ids:

  pagoda  the real processes (launcher: scheduler, worker, gateway, as `make run`), every
          request submitted at once over gRPC (unary Generate), greedy, ignore_eos
  static  transformers `generate` on static batches of 16 in arrival order, left-padded: each
          batch runs to its longest max_tokens, and only each request's own max_tokens count
  CB      transformers continuous batching (`continuous_batching_context_manager` +
          `add_request(max_new_tokens=...)`: `generate_batch` takes one max_new_tokens for all)

Figure: useful output tokens/s = sum of max_tokens / wall time of the run (model load, process
start and a one-request warm-up excluded).

The machine's floor for the workload, from two rates measured in the same run: `R` = GEMM
FLOP/s of a 512x576x1536 matmul in the dtype (the shape of SmolLM2's MLP on a 512-token chunk;
the faster of torch's BLAS and, in fp32, pagoda's kernels/csrc/cpu_gemm.c)
and `B` = copy bandwidth (bytes read + written per second copying 256 MiB). With N = the
parameters the layers multiply by (q, k, v, o, gate, up, down; norms counted as bytes only),
H = the LM head (tied to the embedding, so read once per step; the embedding lookup reads a row
per token and is left out), P_i / O_i the prompt / output length of request i, M = max O_i:

  brief    = prefill / R + (M - 1) * weight_bytes / B
             prefill = sum_i 2 N P_i + 2 L h d P_i (P_i + 1) [causal QK and PV] + 2 H [the
             first output token]; the first token comes from the prefill, the other M - 1 are
             decode steps of all requests together, each bound by one read of the weights.
  roofline = prefill / R + sum over decode steps t = 1..M-1 of max(flops_t / R, bytes_t / B),
             over the requests still running at t (O_i > t): flops_t = 2 (N + H) + 4 L h d
             (P_i + t) each, bytes_t = the weights + each one's KV cache (P_i + t tokens).

Both are optimistic models, not measurements: every matmul at R, no time outside matmuls and
memory traffic, all requests decoding together from the first step; only adding prefill and
decode, as if they never overlapped, errs the other way. `brief` leaves out decode compute and KV
reads, which on a CPU with many sequences running cost more than the weight reads, so
`roofline` is the tighter of the two.

    .venv/bin/python -m bench.offline [--num-requests 64] [--seed 0] [--dtype float32]
        [--skip cb,static] [--pagoda-flags "--num-gpu-blocks-override 512"] [--json out.json]

On a loaded machine prefix OMP_NUM_THREADS=1: every peer (the pagoda worker inherits the
environment) then runs one torch thread. With more threads than free cores, each parallel op
waits at a barrier for a descheduled thread: transformers `generate` ran 6-9x slower with 2
threads than with 1 on this 2-core VM at load 6.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import time
from pathlib import Path

import grpc
from tqdm import tqdm

from bench.workloads import Request, load_hf_model, offline_workload, random_ids
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import Cluster

PEERS = ("pagoda", "static", "cb")
LABELS = {"pagoda": "pagoda (gRPC, all at once)", "static": "transformers generate, static batches of 16",
          "cb": "transformers continuous batching"}
KV_CACHE_BYTES = 1 << 30  # pagoda's --kv-cache-memory default on CPU: CB gets the same budget
# Warm-up prompts share no prefix with the workload, so no peer's prefix cache starts ahead.
WARM_UP = Request(random_ids(random.Random("warm-up"), 16), 4)


def machine_rates(dtype: str) -> tuple[float, float]:
    """(GEMM FLOP/s, copy bytes/s), best of several repeats: a floor wants the machine at its
    best, and on a shared machine the best repeat is the one least disturbed. The GEMM is the
    faster of torch's BLAS and, in fp32, pagoda's own kernel (kernels/csrc/cpu_gemm.c), which outruns
    MKL on some CPUs: a floor at BLAS's rate would be one pagoda can beat."""
    import torch
    dt = getattr(torch, dtype)
    a, b = torch.randn(512, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    products = [lambda: a @ b]
    if dt == torch.float32:
        from pagoda.kernels import cpu_gemm
        if cpu_gemm.available():
            bt = b.t().contiguous()
            products.append(lambda: cpu_gemm.xwt(a, bt))
    best = float("inf")
    for product in products:
        for _ in range(3):
            product()
        best = min(best, *(_timed(product) for _ in range(30)))
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB: far past any cache
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * 512 * 576 * 1536 / best, 2 * src.numel() * 4 / copy


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def floors(reqs: list[Request], cfg, dtype_bytes: int, flops: float, bw: float) -> dict:
    L, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or d // h
    n_lin = L * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * f)
    n_head = cfg.vocab_size * d
    weight_bytes = (n_lin + n_head + (2 * L + 1) * d) * dtype_bytes
    kv_token_bytes = 2 * L * kv * hd * dtype_bytes
    P = [len(r.prompt_ids) for r in reqs]
    O = [r.max_tokens for r in reqs]
    prefill = sum(2 * n_lin * p + 2 * L * h * hd * p * (p + 1) + 2 * n_head for p in P) / flops
    steps = max(O) - 1
    decode_roof = 0.0
    for t in range(1, steps + 1):
        alive = [p for p, o in zip(P, O) if o > t]
        step_flops = sum(2 * (n_lin + n_head) + 4 * L * h * hd * (p + t) for p in alive)
        step_bytes = weight_bytes + sum((p + t) * kv_token_bytes for p in alive)
        decode_roof += max(step_flops / flops, step_bytes / bw)
    return {"params_linear": n_lin, "params_lm_head": n_head, "weight_bytes": weight_bytes,
            "prefill_s": prefill, "decode_steps": steps,
            "brief_s": prefill + steps * weight_bytes / bw, "roofline_s": prefill + decode_roof}


async def _pagoda_all(target: str, reqs: list[Request]) -> tuple[list[list[int]], float]:
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)

        async def one(r: Request) -> list[int]:
            msg = await stub.Generate(pb.GenerateRequest(
                prompt_token_ids=r.prompt_ids, sampling=pb.SamplingParams(temperature=0),
                stopping=pb.StoppingCriteria(max_tokens=r.max_tokens, ignore_eos=True)), timeout=3600)
            return list(msg.token_ids)

        await one(WARM_UP)  # first-step allocations, the channel
        with progress(reqs, "pagoda") as bar:
            async def counted(r: Request) -> list[int]:
                out = await one(r)
                bar.update()
                return out

            t0 = time.perf_counter()
            outs = await asyncio.gather(*(counted(r) for r in reqs))
            return outs, time.perf_counter() - t0


def progress(reqs: list[Request], peer: str) -> tqdm:
    """Requests finished, on stderr (the table goes to stdout); off where stderr is no terminal."""
    return tqdm(total=len(reqs), desc=peer, unit="req", disable=None, leave=False)


def run_pagoda(reqs: list[Request], dtype: str, flags: list[str]) -> tuple[list[list[int]], float]:
    cluster = Cluster("--dtype", dtype, *flags, log_path=Path("/tmp/pagoda-offline.log"),
                      lazy_grammar=False).start(timeout=600)
    try:
        return asyncio.run(_pagoda_all(cluster.target, reqs))
    finally:
        cluster.stop()


def run_static(model, reqs: list[Request], batch: int = 16) -> tuple[list[list[int]], float]:
    import torch
    from transformers import GenerationConfig

    def generate(chunk: list[Request]) -> list[list[int]]:
        width, new = max(len(r.prompt_ids) for r in chunk), max(r.max_tokens for r in chunk)
        ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in chunk])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk])
        cfg = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return [out[i, width:width + r.max_tokens].tolist() for i, r in enumerate(chunk)]

    # ignore_eos: generate fills an unset eos_token_id from model.generation_config (id 2), so
    # clear it there; min_new_tokens instead would mask EOS and change the greedy tokens, and
    # eos_token_id=-1 works but warns on every call.
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        generate([WARM_UP])
        outs: list[list[int]] = []
        with progress(reqs, "static") as bar:
            t0 = time.perf_counter()
            for i in range(0, len(reqs), batch):
                outs += generate(reqs[i:i + batch])
                bar.update(len(reqs[i:i + batch]))
            return outs, time.perf_counter() - t0
    finally:
        model.generation_config.eos_token_id = saved


def run_cb(model, reqs: list[Request]) -> tuple[list[list[int]], float, dict]:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_tokens = KV_CACHE_BYTES // (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * model.dtype.itemsize)
    # pagoda's KV budget and its --max-num-batched-tokens default, rather than CB's own sizing
    # from free RAM (it would take 90% of what this shared machine has free).
    cb_cfg = ContinuousBatchingConfig(max_batch_tokens=2048)
    cb_cfg.num_blocks = -(-kv_tokens // cb_cfg.page_size)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_tokens for r in reqs))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in reqs),
                          max_generated_length=gen.max_new_tokens, num_requests=len(reqs))

    def wait(m, ids: set[str], bar=None) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            res = m.get_result(timeout=1)
            if res is None:
                if not m.is_running():
                    raise RuntimeError(f"CB generation thread died with {len(ids) - len(done)} requests left")
                continue
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"CB request {res.request_id} failed: {res.error}")
                done[res.request_id] = list(res.generated_tokens)
                if bar is not None:
                    bar.update()
        return done

    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb_cfg, workload_hints=hints) as m:
        # eos_token_id=-1 per request too: add_request falls back to the config's value only on None.
        wait(m, {m.add_request(WARM_UP.prompt_ids, "warm-up", max_new_tokens=4, eos_token_id=-1)})
        with progress(reqs, "cb") as bar:
            t0 = time.perf_counter()
            ids = [m.add_request(r.prompt_ids, f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
                   for i, r in enumerate(reqs)]
            done = wait(m, set(ids), bar)
            wall = time.perf_counter() - t0
    return [done[i] for i in ids], wall, {"num_blocks": cb_cfg.num_blocks, "page_size": cb_cfg.page_size,
                                          "max_batch_tokens": cb_cfg.max_batch_tokens}


def mismatches(outs: list[list[int]], ref: list[list[int]], n: int) -> tuple[int, list]:
    """Requests among the first n whose tokens differ, and where each first differs (fp32 ties
    can flip one greedy choice and everything after it)."""
    bad = [(i, next((k for k, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r))))
           for i, (o, r) in enumerate(zip(outs[:n], ref[:n])) if o != r]
    return len(bad), bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    ap.add_argument("--seed", type=int, default=0, help="the workload's lengths and prompts")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every peer's")
    ap.add_argument("--skip", default="", help="comma-separated peers to leave out: pagoda,static,cb")
    ap.add_argument("--pagoda-flags", default="", help='extra launcher flags, e.g. "--max-num-seqs 32"')
    ap.add_argument("--check", type=int, default=4, help="compare the first N requests' tokens with static's")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    opts = ap.parse_args()
    skip = {s.strip() for s in opts.skip.split(",") if s.strip()}
    if skip - set(PEERS):
        ap.error(f"--skip takes {','.join(PEERS)}, got {opts.skip}")
    reqs = offline_workload(opts.num_requests, opts.seed)
    P, O = [len(r.prompt_ids) for r in reqs], [r.max_tokens for r in reqs]
    useful = sum(O)
    print(f"workload: {len(reqs)} requests, seed {opts.seed}, prompts {min(P)}-{max(P)} tokens "
          f"(sum {sum(P)}), outputs {min(O)}-{max(O)} (sum {useful}), dtype {opts.dtype}", flush=True)
    import torch
    threads, load0 = torch.get_num_threads(), os.getloadavg()[0]
    rates = [machine_rates(opts.dtype)]

    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    if "pagoda" not in skip:
        t0 = time.perf_counter()
        outputs["pagoda"], wall = run_pagoda(reqs, opts.dtype, shlex.split(opts.pagoda_flags))
        results["pagoda"] = {"wall_s": wall, "setup_s": time.perf_counter() - t0 - wall}
        print(f"pagoda: {wall:.1f} s", flush=True)
    model = None
    if {"static", "cb"} - skip:
        t0 = time.perf_counter()
        model = load_hf_model(opts.dtype)
        load_s = time.perf_counter() - t0
        if "static" not in skip:
            outputs["static"], wall = run_static(model, reqs)
            results["static"] = {"wall_s": wall, "setup_s": load_s,
                                 "generated_tokens": sum(max(O[i:i + 16]) * len(O[i:i + 16])
                                                         for i in range(0, len(O), 16))}
            print(f"static: {wall:.1f} s", flush=True)
        if "cb" not in skip:
            outputs["cb"], wall, cb_info = run_cb(model, reqs)
            results["cb"] = {"wall_s": wall, "setup_s": load_s, **cb_info}
            print(f"cb: {wall:.1f} s", flush=True)
    rates.append(machine_rates(opts.dtype))
    flops, bw = max(r[0] for r in rates), max(r[1] for r in rates)
    if model is not None:
        cfg = model.config
    else:
        from transformers import AutoConfig

        from modelfiles.resolve import resolve_model
        path = resolve_model("")
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    floor = floors(reqs, cfg, 4 if opts.dtype == "float32" else 2, flops, bw)

    for name, r in results.items():
        got = sum(min(len(o), m) for o, m in zip(outputs[name], O))
        r.update(useful_tokens=got, tok_per_s=got / r["wall_s"],
                 vs_brief_floor=floor["brief_s"] / r["wall_s"] * got / useful,
                 vs_roofline_floor=floor["roofline_s"] / r["wall_s"] * got / useful)
        if got != useful:
            print(f"WARNING: {name} returned {got} of the {useful} tokens asked for")
    ref = outputs.get("static")
    for name in ("pagoda", "cb"):
        if ref is not None and name in outputs:
            n, where = mismatches(outputs[name], ref, opts.check)
            results[name].update(mismatches_vs_static=n, mismatch_at=where)

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cpus, {platform.processor() or platform.platform()}, "
          f"torch threads {threads}, load average {load0:.1f} at start and {os.getloadavg()[0]:.1f} at end "
          f"(shared: figures are noisy)")
    print(f"measured: {opts.dtype} GEMM 512x576x1536 {flops / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s "
          f"(read + write; best of before and after: {', '.join(f'{a / 1e9:.0f}/{b / 1e9:.1f}' for a, b in rates)})")
    print(f"floor: {floor['params_linear'] / 1e6:.1f}M layer + {floor['params_lm_head'] / 1e6:.1f}M LM head "
          f"params, prefill {floor['prefill_s']:.2f} s, {floor['decode_steps']} decode steps; "
          f"brief {floor['brief_s']:.2f} s ({useful / floor['brief_s']:.0f} tok/s), "
          f"roofline {floor['roofline_s']:.2f} s ({useful / floor['roofline_s']:.0f} tok/s)")
    print(f"\n| peer | setup s | wall s | useful tok/s | of brief floor | of roofline floor | greedy mismatches "
          f"(first {opts.check}, vs static) |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        mm = r.get("mismatches_vs_static")
        print(f"| {LABELS[name]} | {r['setup_s']:.1f} | {r['wall_s']:.1f} | {r['tok_per_s']:.1f} | "
              f"{r['vs_brief_floor']:.1%} | {r['vs_roofline_floor']:.1%} | "
              f"{'-' if mm is None else f'{mm}/{min(opts.check, len(reqs))}'} |")
    ratios = {f"pagoda/{k}": results["pagoda"]["tok_per_s"] / results[k]["tok_per_s"]
              for k in ("cb", "static") if "pagoda" in results and k in results}
    if ratios:
        print("\n" + ", ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    for name in ("pagoda", "cb"):
        if results.get(name, {}).get("mismatch_at"):
            print(f"{name} differs from static at (request, first token): {results[name]['mismatch_at']}")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({
            "workload": {"num_requests": len(reqs), "seed": opts.seed, "dtype": opts.dtype,
                         "prompt_tokens": sum(P), "output_tokens": useful, "max_output": max(O)},
            "pagoda_flags": opts.pagoda_flags, "machine": {"gemm_flops": flops, "copy_bytes_per_s": bw,
                                                          "cpus": os.cpu_count(),
                                                          "torch_threads": threads},
            "floor": {**floor, "brief_tok_per_s": useful / floor["brief_s"],
                      "roofline_tok_per_s": useful / floor["roofline_s"]},
            "peers": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
