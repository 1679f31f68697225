"""Each held sequence's grammar matcher (structured outputs), by slot: the mask of the tokens
its grammar allows next, applied to the logits after the logits processors, and the sampled
token fed back. The worker holds every token it samples (the plan ahead needs no scheduler
round trip for it), so the matcher advances here, after the step that sampled the token.

A matcher is always where its sequence's output tokens say: a sequence added to the batch
(first placement, recompute after preemption, another worker's sequence after a loss) replays
its output tokens into a fresh matcher, and a dropped or failed step advances nothing.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from structured.spec import Spec, SpecError


class GrammarRows:
    def __init__(self, make_cache: Callable[[], object]) -> None:
        self._make_cache = make_cache  # built on first use: loading the vocabulary takes seconds
        self._cache = None
        self.matchers: dict[int, object] = {}  # slot -> xgrammar GrammarMatcher
        self.failed: dict[int, str] = {}       # slot -> why it cannot go on

    @property
    def cache(self):
        if self._cache is None:
            self._cache = self._make_cache()
        return self._cache

    def add(self, slot: int, sampling, output_tokens: Sequence[int]) -> None:
        """A sequence enters the batch: a matcher replayed to its output so far."""
        self.drop((slot,))
        if not sampling.HasField("structured_output"):
            return
        spec = Spec.from_proto(sampling.structured_output)
        if spec is None:
            return
        import xgrammar as xgr
        try:
            compiled = self.cache.get(spec)
        except SpecError as e:  # the gateway compiled it; a worker's refusal still ends it cleanly
            self.failed[slot] = f"structured_output does not compile: {e}"
            return
        # The request's stop ids (EOS unless ignore_eos, and its stop_token_ids) end a complete
        # answer; without any, a complete grammar leaves no token allowed (a conflict, reported).
        stops = [int(t) for t in sampling.stop_token_ids]
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                     terminate_without_stop_token=not stops)
        for token in output_tokens:
            if not matcher.accept_token(int(token)):
                self.failed[slot] = "its output so far does not match structured_output"
                return
        self.matchers[slot] = matcher

    def drop(self, slots) -> None:
        for slot in slots:
            self.matchers.pop(int(slot), None)
            self.failed.pop(int(slot), None)

    def constrained(self, slots: Sequence[int]) -> list[int]:
        """Rows (indices into slots) that have a matcher."""
        if not self.matchers:
            return []
        return [i for i, s in enumerate(slots) if s in self.matchers]

    def mask(self, slots: Sequence[int], rows: list[int], vocab_size: int) -> torch.Tensor:
        """xgrammar's int32 bitmask [len(rows), ceil(V / 32)]: bit j of word w set when the
        row's grammar allows token 32w + j next."""
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
        for j, i in enumerate(rows):
            self.matchers[slots[i]].fill_next_token_bitmask(bitmask, j)
        return bitmask

    def accept(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """The step's sampled tokens, for the rows that have a matcher."""
        if not self.matchers:
            return
        for slot, token in zip(slots.tolist(), tokens.tolist()):
            matcher = self.matchers.get(slot)
            if matcher is not None and not matcher.accept_token(int(token)):
                # Only a bug gets here: the token was sampled under this matcher's mask.
                self.matchers.pop(slot)
                self.failed[slot] = f"token {token} does not match structured_output"


def apply_grammar_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """-inf on the tokens each constrained row's grammar forbids (a new tensor: the raw logits
    stay as they were, for logprobs). xgrammar's own kernel reads the bitmask as it is."""
    if not rows:
        return logits
    import xgrammar as xgr
    index = torch.tensor(rows, device=logits.device)
    x = logits[index]
    xgr.apply_token_bitmask_inplace(x, bitmask.to(logits.device), vocab_size=logits.shape[1])
    return logits.index_copy(0, index, x)


def why_no_token(sampling, num_output_tokens: int) -> str:
    """The conflict that left a constrained row no token: a grammar alone always allows one
    (its stop tokens once complete), so the request's other settings took them away."""
    if num_output_tokens < sampling.min_tokens:
        return (f"structured_output allows no token after {num_output_tokens} output tokens: "
                f"the answer is complete, and min_tokens ({sampling.min_tokens}) masks the stop "
                "tokens that would end it")
    if not sampling.stop_token_ids:
        return ("structured_output allows no token: the answer is complete, and ignore_eos "
                "leaves no stop token to end it (add a stop_token_ids entry, or unset ignore_eos)")
    return "structured_output allows no token here: logit_bias or a penalty masked every token it allows"
