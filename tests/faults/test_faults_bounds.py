"""The gateway's gRPC receive limit is the largest valid GenerateRequest, computed from the
request limits (gateway/bounds/grpc_bounds.py): every valid request fits, and the bound is tight."""
from __future__ import annotations

import pytest

from gateway.chat.chat_render import FRAME_CHARS, check_sizes
from gateway.bounds.grpc_bounds import CONTEXT_BOUND, largest_generate_request
from gateway.validation.structured_check import MAX_CHOICES
from gateway.validation.limits import Limits
from proto import pagoda_pb2 as pb

WIDE = "\U0010ffff"  # 4 bytes in UTF-8


def worst_requests(limits: Limits) -> dict[str, pb.GenerateRequest]:
    """Each of the three prompt forms with every field at its limit."""
    chars = limits.max_prompt_chars
    common = dict(
        request_id="r" * limits.max_request_id_bytes, priority=-limits.max_priority,
        truncate_prompt_tokens=2**31 - 1, skip_special_tokens=True, return_prompt_token_ids=True,
        sampling=pb.SamplingParams(
            temperature=1.5, top_p=0.5, top_k=2**31 - 1, min_p=0.5, presence_penalty=-2,
            frequency_penalty=-2, repetition_penalty=1.5, seed=2**64 - 1, n=16,
            logprobs=limits.max_logprobs, prompt_logprobs=limits.max_logprobs,
            logit_bias={2**32 - 1 - i: -100.0 for i in range(limits.max_logit_bias)},
            # The most framing a spec can carry: MAX_CHOICES values filling the byte limit.
            structured_output=pb.StructuredOutput(any_whitespace=True, choice=pb.ChoiceList(
                values=["c" * (limits.max_structured_output_bytes // MAX_CHOICES)] * MAX_CHOICES))),
        stopping=pb.StoppingCriteria(
            max_tokens=2**31 - 1, min_tokens=2**31 - 1, ignore_eos=True,
            include_stop_str_in_output=True,
            stop=["s" * limits.max_stop_string_bytes] * limits.max_stop_strings,
            stop_token_ids=[2**32 - 1] * limits.max_stop_token_ids))
    return {
        "prompt": pb.GenerateRequest(prompt=WIDE * chars, **common),
        "prompt_token_ids": pb.GenerateRequest(prompt_token_ids=[2**32 - 1] * limits.max_model_len,
                                               **common),
        "messages": _messages(limits, common),
        "tools": _with_tools(limits, common),
    }


def _messages(limits: Limits, common: dict) -> pb.GenerateRequest:
    """Every message with every string field set: one character costs 2 bytes of framing more
    as a field of its own than inside another, and a field of 32 (128 bytes) one more, for its
    length's second byte; as many of those as the characters allow, the rest in one content."""
    m, chars = limits.max_messages, limits.max_prompt_chars
    longer = min(3 * m, (chars - 3 * m) // 31)
    lengths = [32] * longer + [1] * (3 * m - longer)
    lengths[0] += chars - sum(lengths)
    return pb.GenerateRequest(messages=[
        pb.ChatMessage(role="assistant", content=WIDE * lengths[3 * i], name=WIDE * lengths[3 * i + 1],
                       tool_call_id=WIDE * lengths[3 * i + 2]) for i in range(m)], **common)


def _with_tools(limits: Limits, common: dict) -> pb.GenerateRequest:
    """As many tools and calls as the characters allow (a tool or a call counts its strings
    twice and FRAME_CHARS more: gateway/chat/chat_render.py), the rest as content."""
    each = 2 * 3 + FRAME_CHARS
    n = min(limits.max_tools, limits.max_tool_calls, limits.max_prompt_chars // (2 * each))
    call = pb.ToolCall(id=WIDE, name=WIDE, arguments=WIDE)
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="assistant", tool_calls=[call] * n,
                                 content=WIDE * (limits.max_prompt_chars - 2 * n * each))],
        tools=[pb.Tool(name=WIDE, description=WIDE, parameters=WIDE)] * n, **common)


@pytest.mark.parametrize("max_model_len", [64, 4096])
def test_every_valid_request_fits_the_computed_limit_and_the_limit_is_tight(max_model_len):
    limits = Limits(max_model_len=max_model_len, vocab_size=0)
    bound = largest_generate_request(limits, max_model_len)
    requests = worst_requests(limits)
    for req in requests.values():
        if req.messages:
            check_sizes(req, limits)  # valid, as far as sizes go
    sizes = {form: req.ByteSize() for form, req in requests.items()}
    print(f"\nmax_model_len {max_model_len}: limit {bound} bytes; largest valid: {sizes}")
    assert max(sizes.values()) <= bound < max(sizes.values()) + 4096


def test_the_default_limit_is_far_below_the_old_64_mib():
    bound = largest_generate_request(Limits(max_model_len=0, vocab_size=0))
    print(f"\ndefault gRPC receive limit (context bound {CONTEXT_BOUND}): {bound / 2**20:.1f} MiB")
    assert bound == largest_generate_request(Limits(max_model_len=CONTEXT_BOUND, vocab_size=0),
                                             CONTEXT_BOUND)
    assert bound < 17 * 2**20
