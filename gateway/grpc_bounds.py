"""The largest GenerateRequest the gateway can accept, computed from its request limits, so that
gRPC's receive limit refuses nothing valid and lets nothing much larger in; and the largest
response it can send (below), for gRPC's send limit.

Protobuf sizes: a length-delimited field costs 1 tag byte + a varint length + its bytes; a uint32
at most 5 bytes; a float 4. A request carries exactly one of prompt, prompt_token_ids and
messages, so the largest of the three counts, plus every other field at its limit:
- prompt: max_model_len x --max-prompt-chars-per-token characters, at most 4 UTF-8 bytes each;
- prompt_token_ids: max_model_len ids;
- messages: the same characters as content, plus --max-messages roles;
- stop strings, stop ids, logit_bias entries, the structured-output spec and request_id at their
  flags' limits;
- 1 KiB for the scalar fields.
max_model_len is the scheduler's, learned after start-up; the bound takes CONTEXT_BOUND, the
longest context the gateway prepares for before it knows.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.structured_check import MAX_CHOICES
from gateway.tokenizer import ROLES, TextTokenizer
from gateway.validate import Limits
from proto.sizes import MAX_ID_BYTES, MAX_LIST, MAX_WORKERS

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
#   characters of 4 bytes, plus, for messages, what the chat template writes around
#   --max-messages messages (measured once for one and for each more; templates insert content
#   verbatim). Every token covers at
#   least one byte of it, except the few special tokens the post-processor adds. Each token costs
#   its id, its spelling (at most `spelling_per_byte` bytes per byte it covers), an Offset of two
#   code-point indices, and the text is echoed once.
# - Detokenize: at most max_model_len ids (it refuses more), so the output text bound above.
# - GetLoads: MAX_WORKERS (the scheduler registers no more) entries of a MAX_ID_BYTES id, five
#   counters and a double; GetModelInfo and Abort: MAX_ID_BYTES / MAX_LIST lists, smaller.
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
                      *_chat_bytes(tok))


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
    text = (4 * max_model_len * limits.max_prompt_chars_per_token + tokens.chat_first_message
            + (limits.max_messages - 1) * tokens.chat_per_message)
    count = text + _SPECIALS
    offset = _field(2 * (1 + _varint(text)))
    spellings = (tokens.spelling_per_byte * text + _SPECIALS * tokens.longest_spelling
                 + count * (1 + _varint(tokens.longest_spelling)))
    return _field(_ID * count) + spellings + count * offset + _field(text) + _SCALARS


def largest_response(limits: Limits, tokens: TokenSizes, max_model_len: int = CONTEXT_BOUND) -> int:
    """The largest message any RPC of the gateway sends: gRPC's send limit."""
    loads = MAX_WORKERS * _field(_field(MAX_ID_BYTES) + 5 * (1 + _ID) + 9) + _SCALARS
    info = _field(MAX_ID_BYTES) + _field(_ID * MAX_LIST) + _SCALARS
    aborted = MAX_LIST * _field(limits.max_request_id_bytes)
    return min(_GRPC_MAX, max(
        largest_generate_response(limits, tokens, max_model_len),
        largest_tokenize_response(limits, tokens, max_model_len),
        _field(largest_output_text(tokens, max_model_len)) + _SCALARS,  # Detokenize
        loads, info, aborted))
