"""Which sequences may speculate: one rule that the scheduler (which allocates the proposals'
slots) and the worker (which proposes and verifies them) both apply to a SamplingConfig.

A verified position must see the logits processors as if the proposals before it had been
sampled. Temperature, min-p, top-k and top-p depend on the position's logits alone, so the
verification applies them as the sampler does; penalties, logit_bias, a pending min_tokens
mask, a grammar, logprobs and beam search depend on more, and such a sequence decodes one token
a step, exactly as without speculation."""
from __future__ import annotations

from proto import internal_pb2 as pb


def may_speculate(sampling: pb.SamplingConfig, num_output_tokens: int) -> bool:
    """num_output_tokens: those the sequence has before this step's token."""
    return not (sampling.HasField("logprobs") or sampling.HasField("structured_output")
                or sampling.beam_candidates or sampling.logit_bias
                or sampling.presence_penalty or sampling.frequency_penalty
                or sampling.repetition_penalty not in (0.0, 1.0)
                or num_output_tokens < sampling.min_tokens)
