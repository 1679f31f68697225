"""--quantization int8 on the real model, against transformers in float64 with the same dequantized
weights (the tied vocabulary projection quantized apart from the embedding): greedy tokens equal
over 8 prompts of up to 64 tokens (the issue's bar: at least 7 of 8), the largest logit error,
and a single stream's decode step, fp32 weights vs int8, in the same run.

    .venv/bin/python bench/quantized_accuracy.py [--threads 2] [--tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import _load_smollm2_hf  # noqa: E402
from tests.plan_driver import PlanDriver  # noqa: E402
from tests.unit.worker.test_worker_int8 import dequantized_float64  # noqa: E402
from tests.worker_tiny_models import runner_args  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

PROMPTS = [[504, 3575, 282, 4649, 314, 47, 33, 1000 + i * 37, 260, 3000 + i] for i in range(8)]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    ref = dequantized_float64(_load_smollm2_hf())
    runner = ModelRunner(runner_args("", "--quantization", "int8", num_blocks=256))
    got = PlanDriver(runner).generate(PROMPTS, opts.tokens)
    equal, worst = 0, 0.0
    for prompt, seq in zip(PROMPTS, got):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=opts.tokens,
                            do_sample=False)[0, len(prompt):].tolist()
        equal += seq.output[:len(want)] == want
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
        n = min(len(want), len(seq.logits))
        worst = max(worst, (torch.stack(seq.logits[:n]).double() - logits[:n]).abs().max().item())
    print(f"int8: greedy equal to float64 on the dequantized weights for {equal} of {len(PROMPTS)} "
          f"prompts over up to {opts.tokens} tokens; largest logit error {worst:.2e}")
    fp32 = ModelRunner(runner_args("", num_blocks=256))
    for name, r in (("fp32", fp32), ("int8", runner), ("fp32", fp32), ("int8", runner)):
        print(f"{name} one-sequence decode step (300-token context): {decode_step_ms(r):.1f} ms")


if __name__ == "__main__":
    main()
