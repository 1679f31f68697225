"""--quantization int8, q8_0 and q4_1 on the real model, each against transformers in float64 with
the same dequantized weights (the tied vocabulary projection quantized apart from the embedding;
for q4_1 the GGUF's own Q4_1 blocks where it stores them): greedy tokens equal over 8 prompts of
up to 64 tokens (the issue's bar: at least 7 of 8), the largest logit error; then a single
stream's decode step, fp32 weights and each format, alternating in the same run, and the median
over the rounds of each one's speed-up on fp32 in the same round.

    .venv/bin/python -m bench.quantized_accuracy [--threads 2] [--tokens 64] [--formats int8,q8_0,q4_1] [--rounds 2] [--int8-activations]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import time

import torch

from pagoda.kernels import cpu_gemm_gguf, cpu_gemm_int8
from modelfiles.resolve import resolve_model
from tests.conftest import _load_smollm2_hf
from tests.plan_driver import PlanDriver
from tests.unit.worker.test_worker_gguf_quant import dequantized_float64 as dequantized_gguf
from tests.unit.worker.test_worker_int8 import dequantized_float64 as dequantized_int8
from tests.worker_tiny_models import runner_args
from worker.model.layers import Linear
from worker.model.loader import gguf_blocks
from worker.runner import ModelRunner

PROMPTS = [[504, 3575, 282, 4649, 314, 47, 33, 1000 + i * 37, 260, 3000 + i] for i in range(8)]


def machine() -> str:
    """lscpu's model name and the instruction sets the kernels choose between."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    have = [f for f in ("avx512f", "avx2", "fma", "f16c", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return (f"{info.get('Model name', '?').strip()}, {torch.get_num_threads()} threads; flags: "
            f"{' '.join(have)}; int8 kernel {cpu_gemm_int8.isa()}, q8_0/q4_1 kernel "
            f"{cpu_gemm_gguf.ISA_NAMES.get(cpu_gemm_gguf.best_isa(), 'none')}")  # the path taken, not the best built


def weight_mb(model) -> float:
    tensors = list(model.state_dict().values())
    for m in model.modules():
        if isinstance(m, Linear):
            tensors += [t for t in (m.w8, m.scale, m.blocks) if t is not None]
    tensors += [t for t in (model.lm_head_int8 or ()) + (model.lm_head_gguf or ())[:1]]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def decode_step_ms(runner, steps: int = 20) -> float:
    """Median time of a one-sequence decode step at a 300-token context (the prefill apart)."""
    times = []
    execute = runner.execute

    def timed(plan):
        t = time.perf_counter()
        result = execute(plan)
        if not plan.new_seqs:
            times.append(time.perf_counter() - t)
        return result
    runner.execute = timed
    try:
        PlanDriver(runner).generate([list(range(100, 400))], steps + 1)
    finally:
        runner.execute = execute
    return statistics.median(times) * 1e3


def accuracy(runner, ref, tokens: int) -> tuple[int, float]:
    """(prompts whose greedy tokens equal the reference's, the largest logit error on the same
    tokens)."""
    equal, worst = 0, 0.0
    for prompt, seq in zip(PROMPTS, PlanDriver(runner).generate(PROMPTS, tokens)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=tokens,
                                do_sample=False)[0, len(prompt):].tolist()
            logits = ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
        equal += seq.output[:len(want)] == want
        # Logits on the same tokens only: up to the first differing one, whose logits still are.
        n = next((i + 1 for i, (a, b) in enumerate(zip(seq.output, want)) if a != b),
                 min(len(want), len(seq.logits)))
        worst = max(worst, (torch.stack(seq.logits[:n]).double() - logits[:n]).abs().max().item())
    return equal, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--formats", default="int8,q8_0,q4_1")
    ap.add_argument("--rounds", type=int, default=2, help="decode-step timings of each, alternating")
    ap.add_argument("--int8-activations", action="store_true",
                    help="q8_0/q4_1 through the kernel's int8-activation paths (kernels/cpu_gemm_gguf.py)")
    opts = ap.parse_args()
    cpu_gemm_gguf.int8_activations = opts.int8_activations
    torch.set_num_threads(opts.threads)
    print(machine())
    hf = _load_smollm2_hf()
    runners = {"fp32": ModelRunner(runner_args("", num_blocks=256))}
    for kind in opts.formats.split(","):
        runners[kind] = ModelRunner(runner_args("", "--quantization", kind, num_blocks=256))
        ref = dequantized_int8(hf) if kind == "int8" else \
            dequantized_gguf(hf, kind, gguf_blocks(resolve_model(""), kind))
        equal, worst = accuracy(runners[kind], ref, opts.tokens)
        del ref
        gc.collect()
        print(f"{kind} ({weight_mb(runners[kind].model):.0f} MB of weights): greedy equal to float64 on "
              f"the dequantized weights for {equal} of {len(PROMPTS)} prompts over up to {opts.tokens} "
              f"tokens; largest logit error {worst:.2e}", flush=True)
    ratios = {name: [] for name in runners}
    for _ in range(opts.rounds):  # alternating, so that a change of the machine's load hits all
        times = {}
        for name, r in runners.items():
            times[name] = decode_step_ms(r)
            print(f"{name} one-sequence decode step (300-token context): {times[name]:.1f} ms", flush=True)
        for name, t in times.items():
            ratios[name].append(times["fp32"] / t)
    print("median over the rounds of fp32's step / each one's, in the same round: " +
          ", ".join(f"{name} {statistics.median(r):.2f}x" for name, r in ratios.items() if name != "fp32"))


if __name__ == "__main__":
    main()
