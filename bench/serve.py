"""Online serving benchmark in the manner of `vllm bench serve`: requests arrive over time
(Poisson, or gamma with --burstiness), stream over gRPC from a pagoda gateway, and each one's
TTFT, TPOT, ITL and end-to-end latency are measured on the client.

    .venv/bin/python -m bench.serve --start --num-prompts 200 --request-rate 4 --ignore-eos
    .venv/bin/python -m bench.serve --target 127.0.0.1:50051 --dataset prefix --prefix-len 512
    .venv/bin/python -m bench.serve --start --sweep-rates 1,2,4,inf --plot /tmp/sweep.png \\
        --goodput ttft:500 tpot:100 --result-file /tmp/sweep.json

Definitions (vLLM's): TTFT = send to first token; TPOT = (E2E - TTFT) / (output tokens - 1),
for requests with more than one token; ITL = the gaps between streamed messages, pooled over
requests (a message may carry several tokens); goodput = requests/s that met every --goodput
SLO. Prompts are token ids (bench/workloads.py), so the figures do not depend on a tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from tqdm import tqdm

from bench.workloads import Request, prefix_dataset, random_dataset, random_ids
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc

GRPC_OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el", "e2el": "e2el"}


@dataclass
class Outcome:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


async def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yields request indices at their arrival times. Gamma intervals with shape k and mean
    1/rate: k = 1 is Poisson, k < 1 burstier, k > 1 more even (vLLM's --burstiness)."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def one(stub, req: Request, ignore_eos: bool, sem: asyncio.Semaphore | None, pbar) -> Outcome:
    if sem is not None:
        await sem.acquire()  # the clock starts at send time, as vLLM's does under a concurrency cap
    out = Outcome(len(req.prompt_ids))
    t0 = last = time.perf_counter()
    try:
        call = stub.GenerateStream(pb.GenerateRequest(
            prompt_token_ids=req.prompt_ids, sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=req.max_tokens, ignore_eos=ignore_eos)), timeout=3600)
        async for msg in call:
            if not msg.token_ids:
                continue
            now = time.perf_counter()
            if out.output_len == 0:
                out.ttft = now - t0
            else:
                out.itl.append(now - last)
            last = now
            out.output_len += len(msg.token_ids)
        out.e2el = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        out.error = f"{e.code().name}: {e.details()}"
    finally:
        if sem is not None:
            sem.release()
        pbar.update(1)
    return out


def stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(outs: list[Outcome], duration: float, slos: dict[str, float]) -> dict:
    ok = [o for o in outs if not o.error]
    good = [o for o in ok if all((getattr(o, k) or 0.0) * 1000 <= ms for k, ms in slos.items())]
    res = {"duration": duration, "completed": len(ok), "failed": len(outs) - len(ok),
           "total_input_tokens": sum(o.prompt_len for o in ok),
           "total_output_tokens": sum(o.output_len for o in ok),
           "request_throughput": len(ok) / duration,
           "output_throughput": sum(o.output_len for o in ok) / duration,
           "total_token_throughput": sum(o.prompt_len + o.output_len for o in ok) / duration}
    if slos:
        res["request_goodput"] = len(good) / duration
    for name, vals in (("ttft", [o.ttft for o in ok]), ("tpot", [o.tpot for o in ok if o.tpot is not None]),
                       ("itl", [g for o in ok for g in o.itl]), ("e2el", [o.e2el for o in ok])):
        for k, v in stats(vals).items():
            res[f"{k}_{name}_ms"] = v
    res["errors"] = sorted({o.error for o in outs if o.error})
    return res


async def bench(target: str, reqs: list[Request], rate: float, burstiness: float, max_concurrency: int | None,
                ignore_eos: bool, slos: dict[str, float], seed: int, vocab: int, progress: bool) -> dict:
    async with grpc.aio.insecure_channel(target, options=GRPC_OPTS) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        # The warm-up prompt shares nothing with the dataset, so it cannot seed the prefix cache.
        warm = await one(stub, Request(random_ids(random.Random(f"warm-up {seed}"), 16, vocab), 4),
                         True, None, tqdm(disable=True))
        if warm.error:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        rng = np.random.default_rng(seed)
        tasks = []
        with tqdm(total=len(reqs), disable=not progress, desc=f"rate {rate}", unit="req") as pbar:
            t0 = time.perf_counter()
            async for i in arrivals(len(reqs), rate, burstiness, rng):
                tasks.append(asyncio.create_task(one(stub, reqs[i], ignore_eos, sem, pbar)))
            outs = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
    res = summarize(outs, duration, slos)
    # "inf" as a string: json.dumps would write Infinity, which strict JSON parsers refuse.
    res.update(request_rate="inf" if math.isinf(rate) else rate, burstiness=burstiness, max_concurrency=max_concurrency,
               input_lens=[o.prompt_len for o in outs], output_lens=[o.output_len for o in outs],
               ttfts=[o.ttft for o in outs], e2els=[o.e2el for o in outs], itls=[o.itl for o in outs])
    return res


def report(res: dict, slos: dict[str, float]) -> None:
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Benchmark duration (s)", res["duration"]), ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"])]
    if slos:
        rows.append(("Request goodput (req/s)", res["request_goodput"]))
    rows += [("Output token throughput (tok/s)", res["output_throughput"]),
             ("Total token throughput (tok/s)", res["total_token_throughput"])]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", None))
        rows += [(f"{k.capitalize()} {name.upper()} (ms)", res[f"{k}_{name}_ms"]) for k in ("mean", "median", "p99")]
    print(f"{'=' * 16} Serving Benchmark Result (request rate {res['request_rate']}) {'=' * 16}")
    for k, v in rows:
        print(k if v is None else f"{k:<42}{v:>12.2f}" if isinstance(v, float) else f"{k:<42}{v:>12}")
    for e in res["errors"]:
        print(f"error: {e}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # inf has no place on a numeric axis: rates are drawn as evenly spaced categories.
    x = list(range(len(runs)))
    labels = [f"{float(r['request_rate']):g}" for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(x, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax1.set_ylabel("output tokens/s")
    ax1b = ax1.twinx()
    ax1b.plot(x, [r["request_throughput"] for r in runs], "s--", color="tab:orange", label="requests/s")
    if "request_goodput" in runs[0]:
        ax1b.plot(x, [r["request_goodput"] for r in runs], "^:", color="tab:green", label="goodput req/s")
    ax1b.set_ylabel("requests/s")
    # From zero (a rise from 2.74 to 2.91 must not look like a doubling), with room for legends;
    # different headroom, or with fixed output lengths the two lines would coincide exactly.
    ax1.set_ylim(0, 1.3 * max(r["output_throughput"] for r in runs) or 1)
    ax1b.set_ylim(0, 1.6 * max(r["request_throughput"] for r in runs) or 1)
    ax1.legend(loc="upper left")
    ax1b.legend(loc="lower right")
    ax1.set_title("throughput")
    for name, color in (("ttft", "tab:blue"), ("tpot", "tab:red")):
        ax2.plot(x, [r[f"median_{name}_ms"] for r in runs], "o-", color=color, label=f"{name.upper()} p50")
        ax2.plot(x, [r[f"p99_{name}_ms"] for r in runs], "o--", color=color, label=f"{name.upper()} p99")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log)")
    ax2.set_title("latency")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(runs[0].get("title", "pagoda"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in SLO_KEYS or not ms:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2e:MS, got {item!r}")
        slos[SLO_KEYS[key]] = float(ms)
    return slos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051", help="a running gateway (ignored with --start)")
    ap.add_argument("--start", action="store_true", help="start the processes here (tests/cluster.py)")
    ap.add_argument("--pagoda-flags", default="", help='launcher flags with --start, e.g. "--dtype float32"')
    ap.add_argument("--dataset", choices=["random", "prefix"], default="random", help="prompts: random ids, or shared prefixes plus random suffixes")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    ap.add_argument("--random-input-len", type=int, default=256, help="prompt length (the suffix for prefix)")
    ap.add_argument("--random-output-len", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn within +-this fraction")
    ap.add_argument("--prefix-len", type=int, default=256, help="shared prefix length (prefix dataset)")
    ap.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (prefix dataset)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second; inf = all at once")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most; none = unbounded")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to max_tokens")
    ap.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2e:MS")
    ap.add_argument("--sweep-rates", default="", help="comma-separated rates (inf allowed); overrides --request-rate")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of throughput and latency against rate")
    ap.add_argument("--result-file", type=Path, default=None, help="JSON of every figure")
    ap.add_argument("--seed", type=int, default=0, help="the dataset and arrival times")
    ap.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    opts = ap.parse_args()
    if opts.burstiness <= 0:
        ap.error("--burstiness must be > 0")
    slos = parse_slos(opts.goodput)
    rates = [float(r) for r in opts.sweep_rates.split(",") if r.strip()] or [opts.request_rate]

    cluster = None
    if opts.start:
        from tests.cluster import Cluster
        cluster = Cluster(*shlex.split(opts.pagoda_flags), log_path=Path("/tmp/pagoda-serve.log"),
                          lazy_grammar=False).start(timeout=600)
        print(f"started pagoda on {cluster.target} (log /tmp/pagoda-serve.log)", flush=True)
    target = cluster.target if cluster else opts.target
    runs = []
    try:
        with grpc.insecure_channel(target, options=GRPC_OPTS) as ch:
            info = pagoda_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        for i, rate in enumerate(rates):
            # Fresh ids per rate, same lengths: no run hits the prefix cache on an earlier run's prompts.
            if opts.dataset == "random":
                reqs = random_dataset(opts.num_prompts, opts.random_input_len, opts.random_output_len,
                                      opts.random_range_ratio, opts.seed, info.vocab_size, salt=i)
            else:
                reqs = prefix_dataset(opts.num_prompts, opts.prefix_len, opts.random_input_len,
                                      opts.random_output_len, opts.random_range_ratio, opts.num_prefixes,
                                      opts.seed, info.vocab_size, salt=i)
            res = asyncio.run(bench(target, reqs, rate, opts.burstiness, opts.max_concurrency, opts.ignore_eos,
                                    slos, opts.seed, info.vocab_size, not opts.disable_tqdm))
            res.update(model=info.model, dataset=opts.dataset, num_prompts=opts.num_prompts, goodput_slos_ms=slos,
                       pagoda_flags=opts.pagoda_flags if opts.start else None, target=target,
                       title=f"{info.model}, {opts.dataset} {opts.random_input_len}/{opts.random_output_len}"
                             f"{f' + prefix {opts.prefix_len}' if opts.dataset == 'prefix' else ''}, "
                             f"{opts.num_prompts} prompts, burstiness {opts.burstiness}")
            report(res, slos)
            runs.append(res)
    finally:
        if cluster:
            cluster.stop()
    if opts.result_file:
        opts.result_file.write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=1))
    if opts.plot:
        plot(runs, opts.plot)
        print(f"plot: {opts.plot}")


if __name__ == "__main__":
    main()
