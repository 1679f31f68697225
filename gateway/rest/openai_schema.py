"""The OpenAI request bodies (with vLLM's extra fields) as pydantic models, and their translation
into pagoda.v1 GenerateRequests. Ranges are checked once, by gateway/validation/validate.py, on the
translated request; an error there names the pagoda field, which `openai_param` turns back into
the name the client sent."""
from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      ValidationError, field_validator)
from pydantic_core import PydanticCustomError

from gateway.rest.openai_structured import ResponseFormat, StructuredOutputsParams
from gateway.rest.openai_tools import MessageToolCall, ToolChoice, ToolDefinition, call_arguments
from proto import pagoda_pb2

# OpenAI's default for /v1/completions (vLLM's too); chat leaves it to what the context allows.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# The ranges of the proto fields the numbers are copied into: protobuf raises ValueError on one
# past them, which was a 500 (`"seed": 2**70`, `"top_k": 2**32`). Refused here
# instead, 400 naming the field; the fields' own ranges are gateway/validation/validate.py's, after.
Int32 = Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
# vLLM takes an int64 seed, the proto field is a uint64: a negative seed travels as its 64 bits
# (seed_bits), so -1 and 2**64 - 1 are the same seed.
Seed = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 64) - 1)]


def seed_bits(seed: int) -> int:
    """The uint64 field's value for an int64 seed; any other value unchanged (protobuf names it)."""
    return seed & ((1 << 64) - 1) if -(1 << 63) <= seed < 0 else seed


class _Strict(BaseModel):
    # Unknown fields are refused, so that a misspelt parameter is not silently ignored. Numbers
    # are StrictFloat: an int or a float, as the document says, not `true` or "0.5" (pydantic's
    # float takes both, which the fuzzer's invalid bodies showed).
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Common(_Strict):
    """Fields both endpoints take."""
    model: str
    n: StrictInt = 1  # bounded before anything is built (HttpApi._generate)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int32 | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: Int32 | None = None
    min_p: StrictFloat | None = None
    seed: Seed | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Int32 = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool | None = None
    truncate_prompt_tokens: Int32 | None = None
    priority: Int32 = 0
    request_id: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among the same salt
    user: str | None = None  # accepted and ignored, as vLLM does
    response_format: ResponseFormat | None = None  # OpenAI's; gateway/rest/openai_structured.py
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's
    # vLLM's beam search fields: n beams, best first (gateway/validation/beam_request.py).
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0
    early_stopping: Union[StrictBool, Literal["never"]] = False


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: Int32 | None = None
    echo: StrictBool = False
    prompt_logprobs: Int32 | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_of_the_shapes(cls, value, handler):
        # pydantic names the union's branch it tried last ("prompt.str"), not the field
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "prompt", "must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids") from None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batch: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: its calls (content may be null)
    tool_call_id: str | None = None                  # tool: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: StrictBool = False
    top_logprobs: Int32 | None = None
    # Function calling (gateway/rest/openai_tools.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # unset: true


TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 32) - 1)]


# POST /tokenize and /detokenize, as HttpApi reads them (field by field, into the gRPC
# requests). A field left out is not null: `None` defaults below only mark them optional.
class TokenizeRequest(_Strict):
    model: str = None  # type: ignore[assignment]  # the served one: else 404
    prompt: str = None  # type: ignore[assignment]
    messages: list[Message] | None = None  # instead of prompt, as chat renders them
    add_special_tokens: StrictBool = None  # type: ignore[assignment]
    tools: list[ToolDefinition] | None = None  # with messages


class DetokenizeRequest(_Strict):
    model: str = None  # type: ignore[assignment]
    tokens: list[TokenId]


_TOKEN_ID = re.compile(r"-?[0-9]{1,12}")
_CALL_ARGUMENTS = re.compile(r"(messages\[\d+\]\.tool_calls\[\d+\])\.arguments")
_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.(name|description|parameters)")


def _sampling(body: _Common, logprobs: int | None) -> pagoda_pb2.SamplingParams:
    s = pagoda_pb2.SamplingParams()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, seed_bits(value) if name == "seed" else value)
    s.n = body.n
    if logprobs is not None:
        s.logprobs = logprobs
    for key, value in (body.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):  # str.isdigit takes "²", which int() refuses
            raise BadField("logit_bias", f"logit_bias keys are token ids, got {key!r}")
        token_id = int(key)
        if not 0 <= token_id < 1 << 32:
            raise BadField("logit_bias", f"logit_bias key {token_id} is not a token id")
        s.logit_bias[token_id] = value
    return s


def _stopping(body: _Common, max_tokens: int | None) -> pagoda_pb2.StoppingCriteria:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    s = pagoda_pb2.StoppingCriteria(
        ignore_eos=body.ignore_eos, stop=stop, min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output)
    for i, t in enumerate(body.stop_token_ids or []):
        if not 0 <= t < 1 << 32:
            raise BadField("stop_token_ids", f"stop_token_ids[{i}] = {t} is not a token id")
        s.stop_token_ids.append(t)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    return s


def _common(body: _Common, req: pagoda_pb2.GenerateRequest) -> None:
    if body.use_beam_search:
        req.sampling.ClearField("n")
        early = body.early_stopping if isinstance(body.early_stopping, str) else str(body.early_stopping).lower()
        req.beam_search.CopyFrom(pagoda_pb2.BeamSearchParams(
            beam_width=body.n, length_penalty=body.length_penalty, early_stopping=early))
    if body.request_id is not None:
        req.request_id = body.request_id
    if body.cache_salt is not None:
        req.cache_salt = body.cache_salt
    req.priority = body.priority
    if body.truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = body.truncate_prompt_tokens
    if body.skip_special_tokens is not None:
        req.skip_special_tokens = body.skip_special_tokens


def completion_requests(body: CompletionRequest, max_prompts: int) -> list[pagoda_pb2.GenerateRequest]:
    """One GenerateRequest per prompt of the batch, at most max_prompts of them."""
    prompts = body.prompts()
    if not prompts:
        raise BadField("prompt", "prompt must not be empty")
    if len(prompts) > max_prompts:
        raise BadField("prompt", f"prompt: a batch of {len(prompts)} prompts, at most "
                                 f"{max_prompts} are allowed (--max-batch-prompts)")
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    out = []
    for i, prompt in enumerate(prompts):
        req = pagoda_pb2.GenerateRequest(sampling=_sampling(body, body.logprobs),
                                         stopping=_stopping(body, max_tokens))
        _common(body, req)
        if body.request_id is not None and len(prompts) > 1:
            req.request_id = f"{body.request_id}-{i}"
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            if any(not 0 <= t < 1 << 32 for t in prompt):
                raise BadField("prompt", f"prompt[{i}] holds a negative or too large token id")
            req.prompt_token_ids.extend(prompt)
        # echo returns the prompt; with logprobs, the prompt's logprobs too.
        req.return_prompt_token_ids = body.echo
        k = body.prompt_logprobs if body.prompt_logprobs is not None else (
            body.logprobs if body.echo and body.logprobs is not None else None)
        if k is not None:
            req.sampling.prompt_logprobs = k
        out.append(req)
    return out


def chat_request(body: ChatCompletionRequest) -> pagoda_pb2.GenerateRequest:
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise BadField("max_completion_tokens",
                       "max_tokens and max_completion_tokens differ; send one of them")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req = pagoda_pb2.GenerateRequest(sampling=_sampling(body, logprobs),
                                     stopping=_stopping(body, max_tokens))
    _common(body, req)
    add_messages(body.messages, req.messages)
    return req


def add_messages(messages: list[Message], out) -> None:
    """OpenAI's messages as pagoda.v1 ChatMessages (GenerateRequest's or TokenizeRequest's)."""
    for i, m in enumerate(messages):
        msg = out.add(role="system" if m.role == "developer" else m.role, content=m.text(),
                      name=m.name or "", tool_call_id=m.tool_call_id or "")
        if m.tool_calls and m.role != "assistant":
            raise BadField(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only "
                                                        f"assistant messages make calls")
        for j, call in enumerate(m.tool_calls or []):
            msg.tool_calls.add(id=call.id, name=call.function.name, arguments=call_arguments(
                call, f"messages[{i}].tool_calls[{j}].function.arguments"))


class BadField(ValueError):
    """A request the schema accepts but pagoda cannot take; becomes a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def openai_param(field: str, chat: bool) -> str:
    """The client's name for a pagoda field that failed validation."""
    if field == "beam_search.beam_width":
        return "n"
    if field == "sampling.logprobs":
        return "top_logprobs" if chat else "logprobs"
    if field == "sampling.prompt_logprobs":
        return "prompt_logprobs"
    if field in ("prompt_token_ids", "prompt"):
        return "prompt"
    if match := _CALL_ARGUMENTS.fullmatch(field):  # ChatMessage.tool_calls[j].arguments
        return f"{match.group(1)}.function.arguments"
    if match := _TOOL_FIELD.fullmatch(field):  # Tool.name -> tools[i].function.name
        return f"{match.group(1)}.function.{match.group(2)}"
    if field.startswith("sampling.structured_output"):
        return "response_format"  # or structured_outputs: the same check, after translation
    if field == "stopping.max_tokens" and chat:
        return "max_completion_tokens"
    for prefix in ("sampling.", "stopping.", "beam_search."):
        if field.startswith(prefix):
            return field[len(prefix):]
    return field
