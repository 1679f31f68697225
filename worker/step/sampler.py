"""Token sampling: logits processors (worker.step.logits), greedy, temperature, min-p, top-k, top-p,
and per-request seeds.

Sampling is an exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. Its only randomness is one noise row per sequence, which makes a seeded row
easy to make stateless: the row's noise comes from a generator seeded by (seed, position) alone,
so the same token comes out after preemption and recompute, whatever else is in the batch.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from worker.grammar.matchers import apply_grammar_mask
from worker.step.logits import LogitsParams, apply_logit_bias, apply_min_p, apply_min_tokens, apply_penalties

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by ~0 only makes NaNs.
SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


class SamplingParams(LogitsParams, Protocol):  # internal_pb2.SamplingConfig has these fields
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int


def seed_for(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_generator(seed: int, position: int, device) -> torch.Generator:
    """The generator of a seeded row's noise at one position: the same token comes out of the
    same distribution whatever else is in the batch."""
    return torch.Generator(device=device).manual_seed(seed_for(seed, position))


def race(probs: torch.Tensor, seed: int | None, position: int, generator: torch.Generator) -> int:
    """One row's token as Sampler draws it: argmax of probs [V] over exponential noise, the
    noise from (seed, position) alone when seeded. Speculative verification draws each position
    this way, so that a seeded row gives the tokens it would give without speculation."""
    g = generator if seed is None else seeded_generator(seed, position, probs.device)
    noise = torch.empty_like(probs).exponential_(generator=g)
    return int(probs.div(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax())


def plain_greedy(p: SamplingParams) -> bool:
    """Whether a row's token is the max of its raw logits: greedy, no logits processor that
    could apply (min_tokens over stop ids, logit_bias, penalties), no logprobs or beam
    candidates asked. (Its grammar, if any, the caller asks worker/grammar/matchers.py.)"""
    return (p.temperature < SAMPLING_EPS and not p.HasField("logprobs") and not p.beam_candidates
            and not p.logit_bias and not (p.min_tokens and p.stop_token_ids)
            and p.repetition_penalty in (0.0, 1.0) and not p.frequency_penalty and not p.presence_penalty)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for unseeded rows, seeded once by --seed

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                 token_ids: Sequence[Sequence[int]] | None = None,
                 num_prompt_tokens: Sequence[int] | None = None,
                 allowed: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """logits [S, V] float32; positions[i] is the index the sampled token will have in its
        sequence (the seeded draw depends on it); token_ids[i] is row i's sequence so far, whose
        first num_prompt_tokens[i] are the prompt (None: no row has any history); allowed is
        (rows, their grammars' bitmask, worker/grammar/matchers.py): the tokens each of those rows may
        take next, masked after the logits processors. Returns int64 [S]: -1 for a row that has no token left
        (nothing is ever sampled from an all-masked row)."""
        if token_ids is None:
            token_ids, num_prompt_tokens = [()] * len(params), [0] * len(params)
        assert num_prompt_tokens is not None, "token_ids needs num_prompt_tokens"
        logits = apply_processors(logits, params, token_ids, num_prompt_tokens)
        masked = allowed is not None and bool(allowed[0])
        if masked:
            logits = apply_grammar_mask(logits, *allowed)
        out = self._sample(logits, params, positions)
        if not masked:
            return out
        # A row with any token left samples one of them; only an all-masked row picks a -inf.
        dead = torch.isneginf(logits.gather(1, out.unsqueeze(1))).squeeze(1)
        return out.masked_fill_(dead, -1)

    def _sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                positions: Sequence[int]) -> torch.Tensor:
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        # max over the vocabulary, not argmax: the same index (the first of tied maxima, the first
        # NaN), in torch's vectorized reduction where argmax's took 2.3 ms for 64 rows on the CPU
        # against 0.8 (an AMX Xeon; about 3% of a bf16 offline run)
        out = logits.max(dim=-1).indices
        if all(greedy):
            return out
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = [params[i] for i in rows]
        x = logits if len(rows) == len(params) else logits[torch.tensor(rows, device=logits.device)]
        probs = probabilities(x, sub)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, p in enumerate(sub):
            if p.has_seed:
                noise[j].exponential_(generator=seeded_generator(p.seed, positions[rows[j]], probs.device))
        # exponential_ can return exactly 0; 0/0 would be NaN and win argmax.
        sampled = probs.div_(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        if len(rows) == len(params):
            return sampled
        return out.index_copy_(0, torch.tensor(rows, device=out.device), sampled)


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                     token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]) -> torch.Tensor:
    """The processors that read a row's history, in vLLM's order: the min_tokens mask,
    logit_bias, penalties. Speculative verification applies them at each proposal's position
    with the proposals before it as history, as if those had been sampled."""
    logits = apply_min_tokens(logits, params, [len(t) - n for t, n in zip(token_ids, num_prompt_tokens)])
    logits = apply_logit_bias(logits, params)
    return apply_penalties(logits, params, token_ids, num_prompt_tokens)


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, min-p, top-k, top-p.
    The rejection sampler verifies proposals against these same distributions."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    x = logits / temps.unsqueeze(1)
    x = apply_min_p(x, [p.min_p for p in params])
    x = apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
    return x.softmax(dim=-1)


def apply_top_k_top_p(x: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Masks logits outside each row's top-k, then outside the smallest set whose probability
    (after top-k) reaches top_p. top_k 0 and top_p outside (0, 1) mean off: proto3 sends 0 for unset."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    ps = [p if 0.0 < p < 1.0 else 1.0 for p in top_p]
    use_k, use_p = any(k < vocab for k in ks), any(p < 1.0 for p in ps)
    if not (use_k or use_p):
        return x
    sorted_x, order = x.sort(dim=-1)  # ascending, so the kept tokens are a suffix
    if use_k:
        k = torch.tensor(ks, device=x.device)
        threshold = sorted_x.gather(1, (vocab - k).unsqueeze(1))
        sorted_x = sorted_x.masked_fill(sorted_x < threshold, float("-inf"))
    if use_p:
        p = torch.tensor(ps, dtype=x.dtype, device=x.device)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
