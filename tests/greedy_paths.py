"""transformers' greedy paths for the speculation tests, computed once per test process: each
prompt's path of `length` tokens, past its end of turn (as with ignore_eos), with the margin
between the top two logits at every position. Both speculation modules read the same paths, so
the reference costs one pass of SmolLM2 over a handful of prompts."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GreedyPath:
    ids: list[int]         # the prompt
    path: list[int]        # the greedy tokens, `length` of them, past the end of turn
    margins: list[float]   # top-1 minus top-2 logit at each position of path


def answer(path: list[int], eos: int) -> list[int]:
    """The greedy answer: the path up to its end of turn, if it has one."""
    return path[:path.index(eos) + 1] if eos in path else path


@functools.cache
def _paths(model, prompts: tuple[tuple[str, tuple[int, ...]], ...], length: int) -> dict[str, GreedyPath]:
    out = {}
    with torch.inference_mode():
        for name, ids in prompts:
            step = model(torch.tensor([ids]), use_cache=True)
            path, margins = [], []
            for _ in range(length):
                logits = step.logits[0, -1]
                top2 = logits.topk(2).values
                margins.append(float(top2[0] - top2[1]))
                path.append(int(logits.argmax()))
                step = model(torch.tensor([[path[-1]]]), past_key_values=step.past_key_values, use_cache=True)
            out[name] = GreedyPath(list(ids), path, margins)
    return out


def greedy_paths(model, prompts: dict[str, list[int]], length: int) -> dict[str, GreedyPath]:
    """prompts: name -> prompt ids. The same model, prompts and length give the same dict."""
    return _paths(model, tuple((n, tuple(ids)) for n, ids in prompts.items()), length)
