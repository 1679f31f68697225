"""Rank 0 of a tensor-parallel worker driven by PlanDriver instead of a scheduler, as a process:

    python -m tests.tp_driver OUT.npz PROMPTS_JSON NEW_TOKENS -- <worker flags>

It starts ranks 1..N-1 exactly as worker.main does (they are real `python -m worker.main`
followers), runs greedy generation of the prompts through plans, and saves every sequence's
tokens and the logits they were sampled from, then stops the group as worker.main does.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch

from tests.plan_driver import PlanDriver
from worker.parallel.ranks import start_group
from worker.runner import ModelRunner
from worker.worker_flags import worker_args


def main(argv: list[str]) -> int:
    out, prompts, new_tokens, sep, *flags = argv
    assert sep == "--"
    args = worker_args(flags)
    group = start_group(args, flags, torch.device("cpu"))
    try:
        runner = ModelRunner(args, group.tp)
        seqs = PlanDriver(runner).generate(json.loads(prompts), int(new_tokens))
        np.savez(out, tokens=np.array([s.output for s in seqs]),
                 logits=np.stack([torch.stack(s.logits).numpy() for s in seqs]),
                 num_blocks=runner.cache.num_blocks, kv_heads=runner.cache.device_cache.shape[4])
    except BaseException:
        group.stop(graceful=False)
        raise
    group.stop(graceful=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
