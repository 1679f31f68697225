"""Beam search: KV blocks at the peak and output tokens/s for beam widths 1, 2, 4, 8, pagoda
against transformers' beam search, in one run, on the same model, dtype and prompt token ids.

  pagoda        the real ModelRunner driven in-process by the real Router (scheduler/), all
                prompts submitted at once; the peak is the most KV blocks in use after any
                plan (blocks are taken when a plan is made and freed when its result comes);
                prefix caching off, so only the beams' copy-on-write sharing counts
  independent   what width x prompts sequences of the same lengths hold without sharing:
                width x ceil((prompt + max_tokens) / block_size) per prompt
  transformers  generate(num_beams=w, num_return_sequences=w, do_sample=False) on the prompts
                as one left-padded batch; its cache is dense, prompts x w x (longest prompt +
                max_tokens) positions, given here in the same 16-token blocks

tokens/s = tokens of every returned beam (prompts x width x max_tokens: EOS is ignored, so
every beam runs to max_tokens) / wall time of the search (model load and a warm-up excluded).

    .venv/bin/python -m bench.beam [--prompts 4] [--prompt-len 128] [--max-tokens 32]
        [--widths 1,2,4,8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from proto import internal_pb2, pagoda_pb2
from proto.token_stream import updates
from scheduler.router import Router, RouterConfig
from tests.plan_driver import run_router
from worker.runner import ModelRunner
from worker.worker_flags import worker_args


def pagoda_run(runner: ModelRunner, prompts, width: int, max_tokens: int) -> tuple[int, float, list]:
    router = Router(RouterConfig(enable_prefix_caching=False, max_num_batched_tokens=2048))
    router.register(b"w", runner.hello())
    runner.forget_all()
    for i, prompt in enumerate(prompts):
        router.add(b"gw", internal_pb2.AddRequest(
            request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
            sampling=internal_pb2.SamplingConfig(),
            beam_search=pagoda_pb2.BeamSearchParams(beam_width=width, length_penalty=1.0,
                                                   early_stopping="false")))
    start = time.perf_counter()
    peak = run_router(router, runner, b"w")
    seconds = time.perf_counter() - start
    outputs = [u for m in router.take_outbox().values() for u in updates(m)]
    assert len(outputs) == len(prompts) * width
    assert all(len(u.token_ids) == max_tokens for u in outputs)
    return peak, seconds, outputs


@torch.inference_mode()
def hf_run(model, prompts, width: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, num_beams=width,
                         num_return_sequences=width, do_sample=False, eos_token_id=None,
                         pad_token_id=0, length_penalty=1.0, early_stopping=False)
    seconds = time.perf_counter() - start
    assert out.shape == (len(prompts) * width, longest + max_tokens)
    return seconds, out[:, longest:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from modelfiles.resolve import resolve_model
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    widths = [int(w) for w in args.widths.split(",")]
    blocks = 512
    runner = ModelRunner(worker_args([
        "--model", "", "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks-override", str(blocks),
        "--max-num-batched-tokens", "2048"]))
    path = resolve_model("")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    pagoda_run(runner, prompts[:1], 2, 4)  # warm-up
    hf_run(hf, prompts[:1], 2, 4)
    bs = runner.block_size
    per_seq = -(-(args.prompt_len + args.max_tokens) // bs)
    rows = []
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, max_tokens {args.max_tokens}, "
          f"block size {bs}, threads {torch.get_num_threads()}")
    print("width  pagoda peak  independent  hf dense  pagoda tok/s  hf tok/s  agree")
    for w in widths:
        peak, seconds, outputs = pagoda_run(runner, prompts, w, args.max_tokens)
        hf_seconds, hf_tokens = hf_run(hf, prompts, w, args.max_tokens)
        ours = {(int(u.request_id[1:]), u.index): u.token_ids for u in outputs}
        agree = sum(ours[(i // w, i % w)] == t for i, t in enumerate(hf_tokens)) / len(hf_tokens)
        tokens = args.prompts * w * args.max_tokens
        row = dict(width=w, pagoda_peak_blocks=peak, independent_blocks=args.prompts * w * per_seq,
                   hf_dense_blocks=args.prompts * w * per_seq, pagoda_tokens_per_s=tokens / seconds,
                   hf_tokens_per_s=tokens / hf_seconds, pagoda_s=seconds, hf_s=hf_seconds,
                   same_beams=agree)
        rows.append(row)
        print(f"{w:5d}  {peak:11d}  {row['independent_blocks']:11d}  {row['hf_dense_blocks']:8d}  "
              f"{row['pagoda_tokens_per_s']:12.1f}  {row['hf_tokens_per_s']:8.1f}  {agree:5.0%}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
