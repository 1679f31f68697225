"""The largest GenerateRequest the gateway can accept, computed from its request limits, so that
gRPC's receive limit refuses nothing valid and lets nothing much larger in; and the largest
response it can send (below), for gRPC's send limit.

Protobuf sizes: a length-delimited field costs 1 tag byte + a varint length + its bytes; a uint32
at most 5 bytes; a float 4. A request carries exactly one of prompt, prompt_token_ids and
messages, so the largest of the three counts, plus every other field at its limit:
- prompt: max_model_len x --max-prompt-chars-per-token characters, at most 4 UTF-8 bytes each;
- prompt_token_ids: max_model_len ids;
- messages: the same characters in any of their strings (content, names, ids, tool calls, and
  the request's tools, which only come with messages; gateway/chat/chat_render.py counts them all,
  each tool and call FRAME_CHARS more), plus each of --max-messages messages at its most
  framing (every string field's tag and length, a role);
- stop strings, stop ids, logit_bias entries, the structured-output spec and request_id at their
  flags' limits;
- 1 KiB for the scalar fields.
max_model_len is the scheduler's, learned after start-up; the bound takes CONTEXT_BOUND, the
longest context the gateway prepares for before it knows.
"""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import Callable

import grpc

from gateway.chat.chat_render import FRAME_CHARS
from gateway.validation.structured_check import MAX_CHOICES
from gateway.tokenizer import ROLES, TextTokenizer
from gateway.validation.limits import Limits
from gateway.validation.validation_error import FIELD_METADATA
from gateway.bounds.wire_fields import largest_field
from proto import pagoda_pb2
from proto.sizes import MAX_ID_BYTES, MAX_LIST, MAX_WORKERS, worker_load_bytes

CONTEXT_BOUND = 1 << 17
_SCALARS = 1024
_LONGEST_ROLE = len("assistant")


def _varint(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field(payload: int) -> int:
    return 1 + _varint(payload) + payload


def context_bound(info) -> int:
    """The scheduler's max_model_len (a ClusterInfo's), or before it has said, the context the
    gateway's size limits are computed for: what bounds Tokenize's and Detokenize's input."""
    return info.max_model_len if info is not None and info.max_model_len else CONTEXT_BOUND


def largest_generate_request(limits: Limits, max_model_len: int = CONTEXT_BOUND) -> int:
    text = 4 * max_model_len * limits.max_prompt_chars_per_token
    # Each message: a tag and a one-byte length for itself, its content, tool_call_id and name,
    # and a role; each length of 128 (16384, ...) bytes or more costs a byte more, and there
    # are at most 4 per message of them, and no more than the text can fill (a message's own
    # length counts its role and framing, 32 bytes at most). A tool or a call is charged
    # FRAME_CHARS characters of the text, more than its own framing costs.
    lengths = 4 * limits.max_messages
    longer = sum(min(lengths, text // (128 ** k - 32)) for k in range(1, 5))
    chat = text + limits.max_messages * (4 * 2 + _field(_LONGEST_ROLE)) + longer
    prompt = max(_field(text), _field(5 * max_model_len), chat)
    # A structured output's spec: its text, plus up to 3 bytes of framing per choice.
    spec = _field(limits.max_structured_output_bytes + 3 * MAX_CHOICES)
    sampling = _field(limits.max_logit_bias * _field(1 + 5 + 1 + 4) + spec + _SCALARS)
    stopping = _field(limits.max_stop_strings * _field(limits.max_stop_string_bytes)
                      + _field(5 * limits.max_stop_token_ids) + _SCALARS)
    return prompt + sampling + stopping + _field(limits.max_request_id_bytes) + _SCALARS


# ---------------------------------------------------------------------------- responses
#
# The largest response, for gRPC's send limit: whatever the gateway can produce under its flags,
# the tokenizer's vocabulary and max_model_len (CONTEXT_BOUND until the scheduler says), so the
# limit refuses nothing valid. Ids and ranks count 5 bytes each (the model's vocabulary may be
# wider than the tokenizer's), floats 4, doubles 8. Per RPC:
# - Generate (unary n = 1; a streamed message holds one index's part of the same, so it is
#   smaller): prompt and output together hold at most max_model_len tokens, and so at most
#   max_model_len ids (token_ids + prompt_token_ids) and scored positions (logprobs +
#   prompt_logprobs). Each position is a TokenLogprob at --max-logprobs: its id, logprob, rank,
#   text (the longest token_text) and token_bytes (the longest token's bytes), plus k
#   TopLogprobs of id, logprob and text. The output text is at most 3 bytes per byte of its
#   tokens (each invalid UTF-8 byte becomes U+FFFD, 3 bytes) and a separator byte a decoder
#   may put between tokens (WordPiece): max_model_len x (3 x longest + 1). Then the request id
#   (the client's, or an internal one), a matched stop string and 1 KiB of scalars (usage,
#   metrics, seed, finish, index).
# - Tokenize: the text tokenized is at most max_model_len x --max-prompt-chars-per-token
#   characters of 4 bytes (tool definitions and calls, which templates write as JSON, count
#   double, and FRAME_CHARS more each: gateway/chat/chat_render.py), plus, for messages, what the
#   chat template writes around --max-messages messages, --max-tools tools and
#   --max-tool-calls calls beyond that (measured once for one and for each more, with empty
#   strings). Every token covers at
#   least one byte of it, except the few special tokens the post-processor adds. Each token costs
#   its id, its spelling (at most `spelling_per_byte` bytes per byte it covers), an Offset of two
#   code-point indices, and the text is echoed once.
# - Detokenize: at most max_model_len ids (it refuses more), so the output text bound above.
# - GetLoads: MAX_WORKERS (the scheduler registers no more) entries of proto.sizes'
#   worker_load_bytes; GetModelInfo and Abort: MAX_ID_BYTES / MAX_LIST lists, smaller.
# gRPC takes a signed 32-bit limit; a bound past it is clipped (nothing larger can be sent).

_ID = 5
_SPECIALS = 16           # tokens a post-processor may add that cover no text (BOS, EOS, ...)
_GRPC_MAX = 2**31 - 1


@dataclass(frozen=True)
class TokenSizes:
    """What one token of the gateway's vocabulary can cost in a response, in bytes."""
    longest_bytes: int           # token_bytes: raw bytes, possibly part of a character
    longest_text: int            # token_text in UTF-8 (a partial character as U+FFFD)
    longest_spelling: int        # the vocabulary's spelling in UTF-8 (Tokenize's `tokens`)
    spelling_per_byte: int       # a token's spelling bytes per raw byte, at most
    chat_first_message: int      # the chat template's own text with one message
    chat_per_message: int        # and for each message more
    chat_tools: int = 0          # what offering one tool adds (the tool template's preamble)
    chat_per_tool: int = 0       # and each tool more
    chat_per_call: int = 0       # each tool call written back


def token_sizes(tok: TextTokenizer) -> TokenSizes:
    """Walks the whole vocabulary once (about a second for 50k tokens; fills the tokenizer's
    per-id caches that logprobs use anyway)."""
    longest_bytes = longest_text = longest_spelling = ratio = 0
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        spelling = len(tok.id_to_token(i).encode())
        longest_bytes = max(longest_bytes, len(raw))
        longest_text = max(longest_text, len(tok.token_text(i).encode()))
        longest_spelling = max(longest_spelling, spelling)
        ratio = max(ratio, -(-spelling // max(1, len(raw))))
    return TokenSizes(longest_bytes, longest_text, longest_spelling, max(1, ratio),
                      *_chat_bytes(tok), *_tool_bytes(tok))


def _chat_bytes(tok: TextTokenizer) -> tuple[int, int]:
    """(the template's text for a first message, for each one more), at most over roles: the
    first may bring a default system prompt, later ones only their own markers."""
    if tok.chat_template is None:
        return 0, 0  # messages are refused: no template
    first, each = [], []
    for a in ROLES:
        for b in ROLES:
            try:  # templates refuse some orders (roles that do not alternate); others measure it
                one = len(tok.render_chat([{"role": a, "content": ""}]).encode())
                two = len(tok.render_chat([{"role": a, "content": ""},
                                          {"role": b, "content": ""}]).encode())
            except Exception:  # noqa: BLE001 - any jinja2 error: this pair is not measured
                continue
            first.append(one)
            each.append(two - one)
    if not first:
        return 4096, 4096  # nothing renders: a generous 4 KiB per message
    return max(first), max(each)


def _tool_bytes(tok: TextTokenizer) -> tuple[int, int, int]:
    """(what one tool adds to a one-message chat, each tool more, each call more), measured
    with empty strings: their own characters are counted apart."""
    if tok.chat_template is None:
        return 0, 0, 0
    user = [{"role": "user", "content": ""}]
    tool = {"type": "function", "function": {"name": "", "description": "", "parameters": {}}}

    def asked(calls: int) -> list[dict]:
        call = {"id": "", "type": "function", "function": {"name": "", "arguments": {}}}
        return user + [{"role": "assistant", "content": "", "tool_calls": [call] * calls}]
    try:
        size = lambda msgs, tools=None: len(tok.render_chat(msgs, tools=tools).encode())  # noqa: E731
        return (max(0, size(user, [tool]) - size(user)), size(user, [tool] * 2) - size(user, [tool]),
                size(asked(2), [tool]) - size(asked(1), [tool]))
    except Exception:  # noqa: BLE001 - a template that refuses these: a generous 4 KiB each
        return 4096, 4096, 4096


def largest_output_text(tokens: TokenSizes, max_model_len: int) -> int:
    return max_model_len * (3 * tokens.longest_bytes + 1)


def largest_token_logprob(tokens: TokenSizes, k: int) -> int:
    top = _field(1 + _ID + 1 + 4 + _field(tokens.longest_text))
    return _field(2 * (1 + _ID) + 1 + 4 + _field(tokens.longest_text)
                  + _field(tokens.longest_bytes) + k * top)


def largest_generate_response(limits: Limits, tokens: TokenSizes,
                              max_model_len: int = CONTEXT_BOUND) -> int:
    ids = 2 * _field(_ID * max_model_len)  # token_ids and prompt_token_ids share the budget
    positions = max_model_len * largest_token_logprob(tokens, limits.max_logprobs)
    return (ids + positions + _field(largest_output_text(tokens, max_model_len))
            + _field(max(limits.max_request_id_bytes, MAX_ID_BYTES))
            + _field(limits.max_stop_string_bytes) + _SCALARS)


def largest_tokenize_response(limits: Limits, tokens: TokenSizes,
                              max_model_len: int = CONTEXT_BOUND) -> int:
    # A tool or a call is charged FRAME_CHARS characters (4 bytes each) of the budget for the
    # JSON around it: only a template that writes more adds to the bound.
    frame = 4 * FRAME_CHARS
    text = (4 * max_model_len * limits.max_prompt_chars_per_token + tokens.chat_first_message
            + (limits.max_messages - 1) * tokens.chat_per_message + tokens.chat_tools
            + max(0, limits.max_tools - 1) * max(0, tokens.chat_per_tool - frame)
            + limits.max_tool_calls * max(0, tokens.chat_per_call - frame))
    # At most one token per byte of text, and at most --max-tokenize-contexts contexts of them.
    count = min(text, limits.max_tokenize_contexts * max_model_len) + _SPECIALS
    offset = _field(2 * (1 + _varint(text)))
    spellings = (min(tokens.spelling_per_byte * text, count * tokens.longest_spelling)
                 + _SPECIALS * tokens.longest_spelling + count * (1 + _varint(tokens.longest_spelling)))
    return _field(_ID * count) + spellings + count * offset + _field(text) + _SCALARS


def largest_response(limits: Limits, tokens: TokenSizes, max_model_len: int = CONTEXT_BOUND) -> int:
    """The largest message any RPC of the gateway sends: gRPC's send limit."""
    loads = MAX_WORKERS * _field(worker_load_bytes()) + _SCALARS
    info = _field(MAX_ID_BYTES) + _field(_ID * MAX_LIST) + _SCALARS
    aborted = MAX_LIST * _field(limits.max_request_id_bytes)
    return min(_GRPC_MAX, max(
        largest_generate_response(limits, tokens, max_model_len),
        largest_tokenize_response(limits, tokens, max_model_len),
        _field(largest_output_text(tokens, max_model_len)) + _SCALARS,  # Detokenize
        loads, info, aborted))


# ---------------------------------------------------------------------------- before parsing
#
# gRPC's receive limit is fixed when the server is built, before the scheduler has said the
# model's context: largest_generate_request at CONTEXT_BOUND, 16 MiB. Parsing that much costs
# the loop tens of milliseconds and up to 8 bytes of arena per byte (a packed id of one byte
# becomes a uint32 in an array that grows by doubling): 6 MB of prompt_token_ids took 57 MB.
# RequestSizeInterceptor refuses, before parsing, a request larger than the largest valid one
# for the context the scheduler has announced.

SERVICE = "/pagoda.v1.Generation/"


def largest_request(method: str, limits: Limits, max_model_len: int) -> int | None:
    """The largest valid request of one Generation method (its name without the service), or
    None where the method takes no list that grows with the context."""
    if method in ("Generate", "GenerateStream", "Tokenize"):  # a TokenizeRequest is a part of one
        return largest_generate_request(limits, max_model_len)
    if method == "Detokenize":
        return _field(_ID * max_model_len) + _SCALARS
    return None


class _Oversized:
    """What the deserializer gives the handler in place of a request it did not parse: invalid
    (no valid request is this large), naming the field that holds most of it."""

    def __init__(self, raw: bytes, bound: int, context: int, descriptor):
        self.field = largest_field(raw, descriptor)
        self.message = (f"{self.field}: the request is {len(raw)} bytes, more than the largest "
                        f"valid one for max_model_len {context} ({bound} bytes); refused before "
                        "parsing")

    async def refuse(self, context) -> None:
        context.set_trailing_metadata(((FIELD_METADATA, self.field),))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.message)


class RequestSizeInterceptor(grpc.aio.ServerInterceptor):
    """Bounds each Generation request's bytes by the model's context once it is known
    (context() returns 0 before: gRPC's receive limit alone applies)."""

    def __init__(self, limits: Limits, context: Callable[[], int]) -> None:
        self.limits = limits
        self.context = context

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(SERVICE) or handler.request_streaming:
            return handler
        method = details.method[len(SERVICE):]
        if largest_request(method, self.limits, 1) is None:
            return handler
        descriptor = pagoda_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name[method].input_type
        return _bounded(handler, lambda: self._bound(method), descriptor)

    def _bound(self, method: str) -> tuple[int, int]:
        context = self.context()
        return (largest_request(method, self.limits, context) or 0, context) if context else (0, 0)


def _bounded(handler: grpc.RpcMethodHandler, bound: Callable[[], tuple[int, int]], descriptor):
    def deserialize(raw: bytes):
        limit, context = bound()
        if limit and len(raw) > limit:
            return _Oversized(raw, limit, context, descriptor)
        return handler.request_deserializer(raw)

    if handler.response_streaming:
        inner = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Oversized):
                await request.refuse(context)
            async with aclosing(inner(request, context)) as responses:
                async for response in responses:
                    yield response
        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=deserialize, response_serializer=handler.response_serializer)
    inner = handler.unary_unary

    async def unary(request, context):
        if isinstance(request, _Oversized):
            await request.refuse(context)
        return await inner(request, context)
    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=deserialize, response_serializer=handler.response_serializer)
