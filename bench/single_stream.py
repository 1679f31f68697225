"""One chat at a time against llama.cpp (issue 26's single-stream goal): pagoda's real stack
(launcher: scheduler, worker, gateway, over gRPC) in fp32, in bf16 and with each --quantization
the worker offers, and llama.cpp's llama-server on the same GGUF, in one run.

Every request is the same for every peer: a prompt of exactly --prompt-tokens (300) token ids,
the chat template around paragraphs of docs/design.md asked to be rewritten, cut to length with
the model's own tokenizer; --max-tokens (160) output tokens with EOS ignored, greedy. Round r
sends prompts r*k .. r*k+k-1 (k = --per-round) to each peer in turn (peers alternate, one
started at a time, a warm-up request first); no prompt is sent twice to a peer, and prefix
caching is off on both sides, so every request pays its whole prefill. Reported per peer, the
median over its requests: end-to-end tokens/s (output tokens over the time from sending to the
last token), decode tokens/s (tokens after the first over the time from the first to the last)
and the time to the first token, all measured here on streamed responses; for llama-server
also its own `timings` (prompt and decode tokens/s).

llama.cpp is never part of this repository: build llama-server yourself (docs/benchmarks.md,
"A single stream against llama.cpp", says how it was built) and pass its path:

    .venv/bin/python -m bench.single_stream --llama-server /tmp/llamacpp/build/bin/llama-server
        [--peers fp32,bf16,int8,q8_0,q4_1,llama] [--rounds 3] [--per-round 2] [--threads 2]
        [--llama-args=--no-repack]
        [--prompt-tokens 300] [--max-tokens 160] [--json out.json]

or set LLAMA_SERVER. Without either, llama.cpp is skipped with a line saying so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
from gateway.tokenizer import load_tokenizer  # noqa: E402
from modelfiles.resolve import resolve_model  # noqa: E402
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc  # noqa: E402
from tests.cluster import Cluster, free_port, wait_for  # noqa: E402

QUANTIZED = ("int8", "q8_0", "q4_1")
ASK = "Rewrite the following text in plain words for a reader new to the subject.\n\n"


def prompts(count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids: chat template + ASK + design.md text."""
    tok = load_tokenizer("")
    head, tail = tok.render_chat([{"role": "user", "content": "\0"}]).split("\0")
    head_ids = tok.encode(head + ASK, add_special_tokens=False)
    tail_ids = tok.encode(tail, add_special_tokens=False)
    room = length - len(head_ids) - len(tail_ids)
    paras = [p.strip() for p in (ROOT / "docs" / "design.md").read_text().split("\n\n")]
    paras = [p for p in paras if len(p) >= 200 and not p.startswith(("#", "|", "```"))]
    out, i = [], 0
    for _ in range(count):
        body: list[int] = []
        while len(body) < room:
            body += tok.encode(paras[i % len(paras)] + "\n\n", add_special_tokens=False)
            i += 1
        out.append(head_ids + body[:room] + tail_ids)
    assert all(len(p) == length for p in out)
    return out


class Pagoda:
    def __init__(self, name: str, quantization: str | None, dtype: str = "float32") -> None:
        self.name = name
        flags = ["--dtype", dtype, "--no-enable-prefix-caching"]
        flags += ["--quantization", quantization] if quantization else []
        self.cluster = Cluster(*flags, log_path=Path(f"/tmp/pagoda-single-stream-{name}.log"), lazy_grammar=False)

    def start(self) -> None:
        self.cluster.start(timeout=600)
        self.channel = grpc.insecure_channel(self.cluster.target)
        self.stub = pagoda_pb2_grpc.GenerationStub(self.channel)

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
        n, t0, first = 0, time.perf_counter(), None
        for msg in self.stub.GenerateStream(req, timeout=3600):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            n += len(msg.token_ids)
        return {"tokens": n, "sent": t0, "first": first, "last": time.perf_counter()}

    def stop(self) -> None:
        if getattr(self, "channel", None):
            self.channel.close()
        self.cluster.stop()


class LlamaServer:
    name = "llama.cpp"

    def __init__(self, binary: str, threads: int, extra: list[str]) -> None:
        self.port = free_port()
        self.cmd = [binary, "-m", str(resolve_model("")), "--host", "127.0.0.1", "--port",
                    str(self.port), "--threads", str(threads), "--threads-batch", str(threads),
                    "--ctx-size", "2048", "--parallel", "1", *extra]

    def start(self) -> None:
        self.log = open("/tmp/pagoda-single-stream-llama.log", "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200
            except OSError:
                return False
        if not wait_for(healthy, timeout=300):
            raise TimeoutError("llama-server not healthy after 300 s")

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        body = {"prompt": ids, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0,
                "top_k": 1, "cache_prompt": False, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, first, final = time.perf_counter(), None, {}
        with urllib.request.urlopen(req, timeout=3600) as resp:
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if first is None and (event.get("content") or event.get("tokens")):
                    first = time.perf_counter()
                if event.get("stop"):
                    final = event
        timings = final.get("timings", {})
        return {"tokens": timings.get("predicted_n", final.get("tokens_predicted", 0)), "sent": t0,
                "first": first, "last": time.perf_counter(), "prompt_n": timings.get("prompt_n"),
                "own_prompt_tok_s": timings.get("prompt_per_second"),
                "own_decode_tok_s": timings.get("predicted_per_second")}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                  if ln.startswith("Model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines()
                      if ln.startswith("Flags")), []))
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile"]
    return (f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(f for f in wanted if f in flags)}, "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="path of a llama-server binary (default: $LLAMA_SERVER)")
    ap.add_argument("--peers", default="fp32,int8,q8_0,q4_1,llama")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=2, help="requests to each peer per round")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's --threads")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server flags, e.g. '--no-repack' where its AMX path crashes")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    wanted = args.peers.split(",")
    offered = subprocess.run([sys.executable, "-m", "worker.main", "--help"], cwd=ROOT,
                             capture_output=True, text=True).stdout
    peers: list = [Pagoda("fp32", None)] if "fp32" in wanted else []
    peers += [Pagoda("bf16", None, "bfloat16")] if "bf16" in wanted else []
    for q in QUANTIZED:
        if q in wanted and q in offered:
            peers.append(Pagoda(q, q))
        elif q in wanted:
            print(f"pagoda {q}: skipped, `worker.main --help` does not offer --quantization {q}")
    if "llama" in wanted and args.llama_server:
        peers.append(LlamaServer(args.llama_server, args.threads, args.llama_args.split()))
    elif "llama" in wanted:
        print("llama.cpp: skipped, no --llama-server PATH and no LLAMA_SERVER")

    print(f"machine: {machine()}", flush=True)
    warm, *todo = prompts(1 + args.rounds * args.per_round, args.prompt_tokens)
    runs: dict[str, list[dict]] = {p.name: [] for p in peers}
    for r in range(args.rounds):
        for peer in peers:
            peer.start()
            try:
                peer.generate(warm, 16)
                for ids in todo[r * args.per_round:(r + 1) * args.per_round]:
                    out = peer.generate(ids, args.max_tokens)
                    out["tok_s"] = out["tokens"] / (out["last"] - out["sent"])
                    out["decode_tok_s"] = (out["tokens"] - 1) / (out["last"] - out["first"])
                    out["ttft_ms"] = 1000 * (out["first"] - out["sent"])
                    runs[peer.name].append(out)
                    print(f"round {r + 1} {peer.name}: {out['tokens']} tokens, {out['tok_s']:.1f} tok/s, "
                          f"decode {out['decode_tok_s']:.1f}, first token {out['ttft_ms']:.0f} ms",
                          file=sys.stderr, flush=True)
            finally:
                peer.stop()
    table(runs, args)
    print(f"machine after: {machine()}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "machine": machine(), "runs": runs}, indent=1))


def table(runs: dict[str, list[dict]], args) -> None:
    print(f"\n{args.prompt_tokens}-token prompts, {args.max_tokens} output tokens (EOS ignored), greedy, "
          f"one request at a time; {args.rounds} alternating rounds of {args.per_round} requests, median")
    print("| peer | end-to-end tok/s | decode tok/s | first token ms | output tokens | "
          "llama.cpp's own prompt / decode tok/s |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "decode_tok_s", "ttft_ms")}
        own = "-"
        if rs[0].get("own_decode_tok_s") is not None:
            own = (f"{statistics.median(r['own_prompt_tok_s'] for r in rs):.0f} / "
                   f"{statistics.median(r['own_decode_tok_s'] for r in rs):.1f} "
                   f"(prompt_n {sorted({r['prompt_n'] for r in rs})})")
        label = name if name == "llama.cpp" else f"pagoda {name}"
        print(f"| {label} | {med['tok_s']:.1f} | {med['decode_tok_s']:.1f} | {med['ttft_ms']:.0f} | "
              f"{sorted({r['tokens'] for r in rs})} | {own} |")


if __name__ == "__main__":
    main()
