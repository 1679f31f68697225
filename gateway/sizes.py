"""The largest GenerateRequest the gateway can accept, computed from its request limits, so that
gRPC's receive limit refuses nothing valid and lets nothing much larger in.

Protobuf sizes: a length-delimited field costs 1 tag byte + a varint length + its bytes; a uint32
at most 5 bytes; a float 4. A request carries exactly one of prompt, prompt_token_ids and
messages, so the largest of the three counts, plus every other field at its limit:
- prompt: max_model_len x --max-prompt-chars-per-token characters, at most 4 UTF-8 bytes each;
- prompt_token_ids: max_model_len ids;
- messages: the same characters as content, plus --max-messages roles;
- stop strings, stop ids, logit_bias entries and request_id at their flags' limits;
- 1 KiB for the scalar fields.
max_model_len is the scheduler's, learned after start-up; the bound takes CONTEXT_BOUND, the
longest context the gateway prepares for before it knows.
"""
from __future__ import annotations

from gateway.validate import Limits

CONTEXT_BOUND = 1 << 17
_SCALARS = 1024
_LONGEST_ROLE = len("assistant")


def _varint(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    return 1 + _varint(payload) + payload


def largest_generate_request(limits: Limits, max_model_len: int = CONTEXT_BOUND) -> int:
    text = 4 * max_model_len * limits.max_prompt_chars_per_token
    prompt = max(
        _field(text),
        _field(5 * max_model_len),
        _field(_field(_LONGEST_ROLE) + _field(text))
        + (limits.max_messages - 1) * _field(_field(_LONGEST_ROLE)))
    sampling = _field(limits.max_logit_bias * _field(1 + 5 + 1 + 4) + _SCALARS)
    stopping = _field(limits.max_stop_strings * _field(limits.max_stop_string_bytes)
                      + _field(5 * limits.max_stop_token_ids) + _SCALARS)
    return prompt + sampling + stopping + _field(limits.max_request_id_bytes) + _SCALARS
