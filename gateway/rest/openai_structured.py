"""OpenAI's `response_format` and vLLM's `structured_outputs` on the HTTP API, translated into
the one pagoda.v1.StructuredOutput a request may carry (gateway/validation/structured_check.py then checks
it as it checks a gRPC request's)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gateway.json_nesting import TooDeep, dumps
from proto import pagoda_pb2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: Union[dict[str, Any], StrictBool, None] = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's StructuredOutputsParams: exactly one of json, regex, choice, grammar, json_object,
    structural_tag."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: Union[str, dict[str, Any], None] = None
    disable_any_whitespace: StrictBool | None = None  # vLLM's; whitespace is not free by default


class StructuredBadField(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def structured_output(response_format: ResponseFormat | None,
                      params: StructuredOutputsParams | None,
                      any_whitespace: bool) -> pagoda_pb2.StructuredOutput | None:
    """The request's one spec, or None for free text. any_whitespace is the gateway's default
    (--structured-outputs-any-whitespace)."""
    out = pagoda_pb2.StructuredOutput(any_whitespace=any_whitespace)
    if params is not None and response_format is not None and response_format.type != "text":
        raise StructuredBadField("structured_outputs",
                                 "send response_format or structured_outputs, not both")
    if response_format is not None:
        if response_format.type == "text":
            return None
        if response_format.type == "json_object":
            out.json_object = True
            return out
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise StructuredBadField("response_format",
                                     "response_format json_schema needs json_schema.schema")
        out.json_schema = _text(spec.json_schema, "response_format")
        return out
    if params is None:
        return None
    kinds = [k for k in ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
             if getattr(params, k) not in (None, False)]
    if len(kinds) != 1:
        raise StructuredBadField("structured_outputs", (
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
            f"and structural_tag, got {len(kinds)}"))
    if params.disable_any_whitespace is not None:
        out.any_whitespace = not params.disable_any_whitespace
    kind = kinds[0]
    if kind == "json_":
        out.json_schema = params.json_ if isinstance(params.json_, str) else _text(params.json_, "structured_outputs")
    elif kind == "choice":
        if not params.choice:
            raise StructuredBadField("structured_outputs", "structured_outputs.choice is empty")
        out.choice.values.extend(params.choice)
    elif kind == "json_object":
        out.json_object = True
    elif kind == "structural_tag":
        tag = params.structural_tag
        out.structural_tag = tag if isinstance(tag, str) else _text(tag, "structured_outputs")
    else:
        setattr(out, kind, getattr(params, kind))
    return out


def _text(value, param: str) -> str:
    """A parsed schema as JSON text; one nested past the encoder's recursion is refused here
    (structured_check.py then bounds the text's depth)."""
    try:
        return dumps(value)
    except TooDeep as e:
        raise StructuredBadField(param, f"{param}: the schema {e}") from None
