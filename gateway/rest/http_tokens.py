"""vLLM's POST /tokenize and /detokenize bodies, read into the gRPC messages the servicer answers,
and a Tokenize answer written as JSON in pieces: a 1 MiB body can hold a million tokens, whose
ids as one list for the framework to encode would take the event loop for seconds."""
from __future__ import annotations

import json

from gateway.rest.http_errors import bad_request
from gateway.rest.openai_schema import BadField, Message, add_messages
from gateway.rest.openai_tools import ToolBadField, ToolDefinition, add_tools
from proto import pagoda_pb2

# Ids written per json.dumps call: each call holds the GIL, so a million-id answer is written in
# steps the loop can run between (as large_inputs.py builds the protobuf answer).
_CHUNK = 8192


def refuse_unknown(data: dict, known: set[str]) -> None:
    unknown = set(data) - known
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])


def tokenize_request(data: dict) -> pagoda_pb2.TokenizeRequest:
    """The body (its `model` already checked and taken out) as a TokenizeRequest; 400 naming the
    field at fault."""
    refuse_unknown(data, {"prompt", "messages", "add_special_tokens", "tools"})
    # As the OpenAPI document's TokenizeRequest says (the fuzzer's invalid bodies passed):
    # `false` is no list, and protobuf's bool takes 0 and 1.
    for name, kind, what in (("messages", list, "a list"), ("tools", list, "a list"),
                             ("add_special_tokens", bool, "true or false")):
        if data.get(name) is not None and type(data[name]) is not kind:
            raise bad_request(f"{name} must be {what}", name)
    msg = pagoda_pb2.TokenizeRequest()
    try:
        if "prompt" in data:
            msg.prompt = data["prompt"]
        # The chat request's own shapes, so that a prompt is counted as chat renders it.
        add_messages([Message.model_validate(m) for m in data.get("messages") or []], msg.messages)
        add_tools([ToolDefinition.model_validate(t) for t in data.get("tools") or []], msg.tools)
        if "add_special_tokens" in data:
            msg.add_special_tokens = data["add_special_tokens"]
    except (BadField, ToolBadField) as e:
        raise bad_request(str(e), e.param) from None
    except (TypeError, KeyError, ValueError) as e:  # pydantic's errors are ValueErrors
        raise bad_request(f"a malformed tokenize request: {e}") from None
    return msg


def detokenize_request(data: dict) -> pagoda_pb2.DetokenizeRequest:
    refuse_unknown(data, {"tokens"})  # as /tokenize does (the fuzzer found extra fields ignored)
    tokens = data.get("tokens")
    # type(): `true` is an int to Python, which protobuf then refused (a 500)
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    return pagoda_pb2.DetokenizeRequest(token_ids=tokens)


def tokenize_json(ids, max_model_len: int | None) -> bytes:
    """{"count", "tokens", "max_model_len"} for a Tokenize answer's token_ids."""
    pieces = [json.dumps(ids[at:at + _CHUNK])[1:-1] for at in range(0, len(ids), _CHUNK)]
    return (f'{{"count": {len(ids)}, "tokens": [{", ".join(p for p in pieces if p)}], '
            f'"max_model_len": {json.dumps(max_model_len)}}}').encode()
