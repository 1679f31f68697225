"""Which sequences may speculate: one rule that the scheduler (which allocates the proposals'
slots) and the worker (which proposes and verifies them) both apply to a SamplingConfig.

A verified position must see everything the sampler would have seen had the proposals before it
been sampled. Temperature, min-p, top-k and top-p depend on the position's logits alone;
penalties, logit_bias and the min_tokens mask on the history too, which the verification builds
per position (worker/speculation/speculator.py), a grammar's mask too (its matcher advanced over the
proposals and rolled back), and logprobs come for each token of a run. Beam search (its group
picks the tokens from candidates) does not speculate: it decodes one token a step."""
from __future__ import annotations

from proto import internal_pb2 as pb


def may_speculate(sampling: pb.SamplingConfig) -> bool:
    return not sampling.beam_candidates
