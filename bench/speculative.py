"""Speculative decoding's worth: decode tokens/s with and without --speculative-config on the
real stack (launcher: scheduler, worker, gateway over gRPC), greedy, on workloads built from
local text, one stream at a time and 16 at once:

  repetitive      answers that repeat their context with edits: pagoda's own functions rewritten
                  with one name changed, and paragraphs of its docs with misspelt words to correct
  quote-mix       the functions again, alternating with paragraphs to quote and summarise: the
                  repetitive workload of stops 33-37, kept to compare. SmolLM2-135M does not
                  quote (greedy: "This is a complete example of a chatbot's response..."), so
                  half its answers do not repeat their context
  non-repetitive  open questions (explanations, stories, advice)

The prompts are kept in bench/data/speculative_workloads.json, as the tree of fe61a75 built them
(build_workloads), so that every stop measures the same text.

Greedy with speculation gives the very tokens it gives without (tests/integration/
test_integration_speculation.py), so the two runs of a workload produce the same tokens and
tokens/s compare directly: output tokens / wall time end to end, and decode tokens/s (tokens
after each request's first over the time from its first token to its last: the prefill, which
speculation does not touch, left out); cluster start and a warm-up excluded.
Every configuration's cluster is started first and stays up; passes alternate between them
(off, on, off, on, ...), so that a slow spell of the VM falls on all of them alike, and the
table gives each one's median of --repeats passes, with the acceptance counters the scheduler
reports (GetLoads), and the median of the paired ratios (each pass against the off pass before it).

    .venv/bin/python -m bench.speculative [--dtype float32] [--quantization q4_1] [--repeats 3]
        [--max-tokens 128]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}' [--spec ...]]
        [--only repetitive/1,non-repetitive/16] [--json out.json]

Each --spec is a configuration of its own, alternating with the others and with no speculation;
a table per --spec compares it with no speculation. --only measures those workload/streams.
"""
from __future__ import annotations

import argparse
import ast
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc  # noqa: E402
from tests.cluster import Cluster  # noqa: E402

QUESTIONS = [
    "Why do leaves change colour in autumn?", "Give three tips for a first job interview.",
    "Write a short story about a lighthouse keeper.", "How does a refrigerator keep food cold?",
    "What should I pack for a week of hiking?", "Explain why the sea is salty.",
    "Describe a walk through a night market.", "How do vaccines train the immune system?",
    "Suggest a plan for learning to play the guitar.", "What makes a good neighbour?",
    "Why do cats purr?", "Invent a new board game and explain its rules.",
    "How do bees make honey?", "What are the pros and cons of working from home?",
    "Describe the taste of a ripe mango to someone who never had one.", "How do tides work?",
]


def _functions(limit: int = 16) -> list[tuple[str, str]]:
    """Short functions of pagoda's scheduler, each with an argument or local name to rename."""
    out = []
    for path in sorted((ROOT / "scheduler").glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef) or not 6 <= node.end_lineno - node.lineno <= 18:
                continue
            names = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 2]
            if names:
                out.append((ast.get_source_segment(source, node), names[0]))
            if len(out) == limit:
                return out
    return out


def _paragraphs(limit: int = 16) -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    paras = [p.strip() for p in text.split("\n\n")]
    return [p for p in paras if 300 <= len(p) <= 900 and not p.startswith(("#", "|", "```"))][:limit]


def misspelt(paragraph: str) -> str:
    """Every ninth word of five letters or more with its third and fourth letters swapped."""
    words = paragraph.split(" ")
    for i in range(3, len(words), 9):
        if len(words[i]) > 4 and words[i].isalpha():
            words[i] = words[i][:2] + words[i][3] + words[i][2] + words[i][4:]
    return " ".join(words)


def _alternate(a: list[str], b: list[str]) -> list[str]:
    return [x for pair in zip(a, b) for x in pair][:16]


# The prompts as built from the tree at fe61a75 and kept: an edit to the first scheduler
# functions or design.md paragraphs would otherwise change the workload, and the acceptance with
# it, without a word. --write-workloads builds them again from the tree (then earlier figures
# no longer compare).
WORKLOADS_FILE = ROOT / "bench" / "data" / "speculative_workloads.json"


def workloads() -> dict[str, list[str]]:
    return json.loads(WORKLOADS_FILE.read_text())


def build_workloads() -> dict[str, list[str]]:
    rewrite = [f"Rewrite this Python function with `{name}` renamed to `{name}_new`. Show the whole "
               f"function and nothing else.\n\n```python\n{code}\n```" for code, name in _functions()]
    correct = [f"Correct the spelling mistakes in this paragraph. Reply with the corrected paragraph "
               f"only.\n\n{misspelt(p)}" for p in _paragraphs()]
    quote = [f"Quote this paragraph exactly, then summarise it in one sentence.\n\n{p}"
             for p in _paragraphs()]
    return {"repetitive": _alternate(rewrite, correct), "quote-mix": _alternate(rewrite, quote),
            "non-repetitive": QUESTIONS[:16]}


def request(content: str, max_tokens: int, salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=content)], cache_salt=salt,
                              sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def measure(stub, prompts: list[str], streams: int, max_tokens: int, salt: str) -> tuple[float, float, int]:
    """With `streams` requests in flight: output tokens/s end to end, decode tokens/s (each
    request's tokens after its first over the time from its first token to its last, summed
    over requests: the prefill left out) and the tokens."""
    def one(content: str) -> tuple[int, float]:
        n, first = 0, None
        for msg in stub.GenerateStream(request(content, max_tokens, salt), timeout=3600):
            if msg.token_ids and first is None:
                first, n = time.perf_counter(), n - 1  # the first token comes from the prefill
            n += len(msg.token_ids)
        return n, time.perf_counter() - first

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in done) + len(done)
    return tokens / wall, sum(n for n, _ in done) / sum(t for _, t in done), tokens


def start(dtype: str, quantization: str | None, spec: str | None, name: str) -> Cluster:
    flags = ["--dtype", dtype, "--max-num-seqs", "16", "--num-gpu-blocks-override", "1024"]
    if quantization:
        flags += ["--quantization", quantization]
    if spec:
        flags += ["--speculative-config", spec]
    cluster = Cluster(*flags, log_path=Path(f"/tmp/pagoda-speculative-{name}.log"),
                      lazy_grammar=False).start(timeout=600)
    with grpc.insecure_channel(cluster.target) as ch:
        pagoda_pb2_grpc.GenerationStub(ch).Generate(request("Hello", 8), timeout=600)  # warm-up
    return cluster


def run(cluster: Cluster, max_tokens: int, single: int, only: set[str], salt: str) -> dict:
    """One pass of every selected workload on a cluster that is already up (an idle cluster
    waits on its sockets and takes no CPU from the one measured). The pass's own cache salt
    keeps the prompts' blocks of earlier passes out of its prefix cache: each pass prefills."""
    out = {}
    with grpc.insecure_channel(cluster.target) as ch:
        stub = pagoda_pb2_grpc.GenerationStub(ch)
        for name, prompts in workloads().items():
            for streams, subset in ((1, prompts[:single]), (16, prompts)):
                if only and f"{name}/{streams}" not in only:
                    continue
                before = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).workers[0]
                rate, decode, tokens = measure(stub, subset, streams, max_tokens, salt)
                after = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).workers[0]
                drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                drafts = after.spec_num_drafts - before.spec_num_drafts
                out[f"{name}/{streams}"] = {
                    "tok_s": rate, "decode_tok_s": decode, "tokens": tokens,
                    "acceptance": accepted / drafted if drafted else 0.0,
                    "mean_len": 1 + accepted / drafts if drafts else 1.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", choices=["int8", "q8_0", "q4_1"], help="weights (default: the dtype's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--single", type=int, default=4, help="requests of each single-stream run")
    ap.add_argument("--spec", action="append",
                    help='default: {"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--only", default="", help="workload/streams keys, comma-separated")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write-workloads", action="store_true",
                    help=f"build the prompts from the tree again into {WORKLOADS_FILE.relative_to(ROOT)}, and stop")
    args = ap.parse_args()
    if args.write_workloads:
        WORKLOADS_FILE.parent.mkdir(exist_ok=True)
        WORKLOADS_FILE.write_text(json.dumps(build_workloads(), indent=1) + "\n")
        print(f"wrote {WORKLOADS_FILE}")
        return
    specs = args.spec or ['{"method": "ngram", "num_speculative_tokens": 4}']
    only = {k for k in args.only.split(",") if k}
    configs = [("off", None)] + [(f"on{i}" if len(specs) > 1 else "on", s) for i, s in enumerate(specs)]
    runs: dict[str, list[dict]] = {c: [] for c, _ in configs}
    clusters = {}
    try:
        for config, spec in configs:
            clusters[config] = start(args.dtype, args.quantization, spec, config)
        for i in range(args.repeats):
            for config, _spec in configs:
                runs[config].append(run(clusters[config], args.max_tokens, args.single, only, f"pass-{i}"))
                print(config, json.dumps(runs[config][-1]), file=sys.stderr, flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    for (config, spec) in configs[1:]:
        table(runs, config, spec, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs}, indent=1))


def table(runs: dict[str, list[dict]], config: str, spec: str, args) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, dtype {args.dtype}, "
          f"quantization {args.quantization or 'none'}, "
          f"spec {spec}, {args.repeats} alternating runs, median")
    print("| workload | streams | off tok/s | on tok/s | speed-up | off decode tok/s | on decode "
          "tok/s | decode speed-up | paired speed-up | paired decode speed-up | acceptance | "
          "mean accepted length |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in runs["off"][0]:
        med = {c: {f: statistics.median(r[key][f] for r in runs[c]) for f in runs[c][0][key]}
               for c in ("off", config)}
        off, on = med["off"], med[config]
        paired = {f: statistics.median(b[key][f] / a[key][f] for a, b in zip(runs["off"], runs[config]))
                  for f in ("tok_s", "decode_tok_s")}
        name, streams = key.split("/")
        print(f"| {name} | {streams} | {off['tok_s']:.1f} | {on['tok_s']:.1f} | "
              f"{on['tok_s'] / off['tok_s']:.2f}x | {off['decode_tok_s']:.1f} | {on['decode_tok_s']:.1f} | "
              f"{on['decode_tok_s'] / off['decode_tok_s']:.2f}x | {paired['tok_s']:.2f}x | "
              f"{paired['decode_tok_s']:.2f}x | {on['acceptance']:.0%} | "
              f"{on['mean_len']:.2f} |")
        tokens = {r[key]["tokens"] for r in runs["off"] + runs[config]}
        if len(tokens) != 1:
            print(f"  ! {key}: token counts differ between runs: {sorted(tokens)}")


if __name__ == "__main__":
    main()
