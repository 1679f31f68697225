"""Beam search at the edge: its request fields checked (it is exclusive with sampling), and the
unary answer assembled from its beam_width final messages. The search itself is the
scheduler's (scheduler/beam_search.py)."""
from __future__ import annotations

import math

from gateway.validation.validation_error import ValidationError
from proto import internal_pb2, pagoda_pb2
from proto.sizes import MAX_BEAM_WIDTH

EARLY_STOPPING = ("true", "false", "never")

# Sampling fields that mean nothing to a deterministic search, with their neutral values (a
# request may spell those out). None: any value is refused.
_EXCLUSIVE = (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
              ("seed", None), ("n", 1), ("logprobs", None), ("prompt_logprobs", None))


def beam_params(req: pagoda_pb2.GenerateRequest) -> pagoda_pb2.BeamSearchParams | None:
    """The request's beam search with its defaults filled, None without one; raises
    ValidationError naming the field."""
    if not req.HasField("beam_search"):
        return None
    b = req.beam_search
    if not 1 <= b.beam_width <= MAX_BEAM_WIDTH:
        raise ValidationError("beam_search.beam_width", f"beam_search.beam_width must be between "
                                                        f"1 and {MAX_BEAM_WIDTH}, got {b.beam_width}")
    penalty = b.length_penalty if b.HasField("length_penalty") else 1.0
    if not math.isfinite(penalty) or abs(penalty) > 1e3:
        raise ValidationError("beam_search.length_penalty",
                              f"beam_search.length_penalty must be a finite number in "
                              f"[-1000, 1000], got {penalty:g}")
    early = b.early_stopping or "false"
    if early not in EARLY_STOPPING:
        raise ValidationError("beam_search.early_stopping", "beam_search.early_stopping must be "
                              f"one of {', '.join(EARLY_STOPPING)}, got {early[:32]!r}")
    s = req.sampling
    for name, neutral in _EXCLUSIVE:
        if s.HasField(name) and (neutral is None or getattr(s, name) != neutral):
            raise ValidationError(f"sampling.{name}", f"sampling.{name} cannot be used with "
                                                      "beam_search, which does not sample")
    if s.logit_bias:
        raise ValidationError("sampling.logit_bias", "sampling.logit_bias cannot be used with "
                                                     "beam_search")
    if req.stopping.stop:
        raise ValidationError("stopping.stop", "stopping.stop (stop strings) cannot be used with "
                                               "beam_search; stop_token_ids can")
    if req.stopping.min_tokens:
        raise ValidationError("stopping.min_tokens", "stopping.min_tokens cannot be used with "
                                                     "beam_search")
    return pagoda_pb2.BeamSearchParams(beam_width=b.beam_width, length_penalty=penalty,
                                       early_stopping=early)


def beam_sampling() -> internal_pb2.SamplingConfig:
    """What the beams' forward needs: greedy (the scheduler picks among the candidates)."""
    return internal_pb2.SamplingConfig(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def add_completion(out: pagoda_pb2.GenerateResponse, response: pagoda_pb2.GenerateResponse) -> None:
    """Generate's answer: every beam in `completions` (best first), and the best one's fields
    at the top, as for a single completion."""
    c = out.completions.add(index=response.index, text=response.text,
                            token_ids=response.token_ids, finish_reason=response.finish_reason,
                            cumulative_logprob=response.cumulative_logprob)
    if response.HasField("matched_token_id"):
        c.matched_token_id = response.matched_token_id
    out.completions.sort(key=lambda c: c.index)
    if response.index == 0:
        completions = list(out.completions)
        out.CopyFrom(response)
        out.completions.extend(completions)
    out.usage.completion_tokens = sum(len(c.token_ids) for c in out.completions)
