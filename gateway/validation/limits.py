"""The gateway's bounds on one request and what the cluster can take: read by validation, chat
rendering and the response-size bounds alike, so it sits apart from all of them."""
from __future__ import annotations

from dataclasses import dataclass

from gateway.gateway_flags import REQUEST_LIMITS

# Sequences one request may ask for (sampling.n, HTTP's n), fixed: a client's n builds n of
# everything at once. Beam search's own bound is proto/sizes.py MAX_BEAM_WIDTH, which the
# scheduler checks too; both sit below what the internal link carries (MAX_REQUEST_SEQUENCES).
MAX_N = 16

_LIMIT_DEFAULTS = {dest: default for dest, default, _, _ in REQUEST_LIMITS}


@dataclass(frozen=True)
class Limits:
    """What the cluster can take (max_model_len, vocab_size: learned from ClusterInfo) and the
    gateway's bounds on one request (its flags, see gateway.gateway_flags.REQUEST_LIMITS)."""
    max_model_len: int
    vocab_size: int
    max_stop_strings: int = _LIMIT_DEFAULTS["max_stop_strings"]
    max_stop_string_bytes: int = _LIMIT_DEFAULTS["max_stop_string_bytes"]
    max_stop_token_ids: int = _LIMIT_DEFAULTS["max_stop_token_ids"]
    max_messages: int = _LIMIT_DEFAULTS["max_messages"]
    max_logit_bias: int = _LIMIT_DEFAULTS["max_logit_bias"]
    max_request_id_bytes: int = _LIMIT_DEFAULTS["max_request_id_bytes"]
    max_priority: int = _LIMIT_DEFAULTS["max_priority"]
    max_logprobs: int = _LIMIT_DEFAULTS["max_logprobs"]
    max_prompt_chars_per_token: int = _LIMIT_DEFAULTS["max_prompt_chars_per_token"]
    max_structured_output_bytes: int = _LIMIT_DEFAULTS["max_structured_output_bytes"]
    max_tools: int = _LIMIT_DEFAULTS["max_tools"]
    max_tool_calls: int = _LIMIT_DEFAULTS["max_tool_calls"]
    max_tokenize_contexts: int = _LIMIT_DEFAULTS["max_tokenize_contexts"]
    max_large_input_jobs: int = _LIMIT_DEFAULTS["max_large_input_jobs"]
    max_large_input_bytes: int = _LIMIT_DEFAULTS["max_large_input_bytes"]
    large_input_wait_seconds: int = _LIMIT_DEFAULTS["large_input_wait_seconds"]
    max_whole_answer_bytes: int = _LIMIT_DEFAULTS["max_whole_answer_bytes"]
    max_whole_answers_bytes: int = _LIMIT_DEFAULTS["max_whole_answers_bytes"]

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_prompt_chars_per_token

    @property
    def max_tokenize_tokens(self) -> int:
        return self.max_model_len * self.max_tokenize_contexts


def limits_from_args(args, max_model_len: int, vocab_size: int) -> Limits:
    """Limits from the gateway's parsed flags; a flag the namespace lacks keeps its default."""
    bounds = {dest: getattr(args, dest, default) for dest, default in _LIMIT_DEFAULTS.items()}
    return Limits(max_model_len=max_model_len, vocab_size=vocab_size, **bounds)
