"""Function calling on the HTTP API: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
checked and translated into the GenerateRequest (its tools, rendered by the chat template, and
for tool_choice "required" or a named function the structural tag of gateway/chat/tool_grammar.py as
its structured output), and how the answer is then read (gateway/rest/tool_render.py).

tool_choice "none" renders the tools all the same (as vLLM does, unless
--exclude-tools-when-tool-choice-none) but reads the answer as plain content; "auto" (the
default with tools) parses calls out of free text with --tool-call-parser; "required" and a
named function are enforced by the grammar, so their arguments always parse against the
function's parameters. A function's `strict` is accepted: forced calls are always held to the
schema, "auto" ones never are. Only a grammar that runs is compiled: the forced call's, once
per request and within one bound (check_tools); "auto" and "none" compile nothing."""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool

from gateway.grammar.grammar_check import TOO_SLOW
from gateway.chat.tool_grammar import PARSER as FORCED_PARSER, tool_call_tag
from proto import pagoda_pb2
from structured.spec import Spec

# OpenAI's rule for function names.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Strict):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # OpenAI sends JSON text; some clients an object


class MessageToolCall(_Strict):
    """An assistant message's tool_calls entry, sent back in the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolBadField(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolConfig:
    """The gateway's flags that shape function calling."""
    parser: str = "hermes"                  # --tool-call-parser
    exclude_tools_when_none: bool = False   # --exclude-tools-when-tool-choice-none
    max_spec_bytes: int = 32 << 10          # --max-structured-output-bytes
    max_tools: int = 128                    # --max-tools


@dataclass(frozen=True)
class ToolMode:
    """How a chat answer is read: parsed for calls with `parser` (None: plain content)."""
    parser: str | None
    parallel: bool = True       # False: at most one call, the first
    named: str | None = None    # tool_choice named it: finish_reason stays "stop", as OpenAI's


@dataclass(frozen=True)
class ToolCheck:
    """A grammar that must compile for the request to run, the field it names, and the parts to
    compile one by one when it does not, to name the one at fault."""
    param: str
    spec: Spec
    parts: list[tuple[str, Spec]] = field(default_factory=list)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _spec(tag: str) -> Spec:
    return Spec("structural_tag", tag)


async def check_tools(checks: list[ToolCheck], grammar_error, budget_s: float) -> None:
    """Raises ToolBadField for the first check that does not compile. grammar_error(spec) is
    the servicer's (the compiler's reason, or None). A grammar that does not compile is
    compiled again part by part to name the function at fault, the parts together within
    budget_s (--max-grammar-compile-seconds): one bound for the request, not one per part (128
    functions of a slow schema each would be minutes); past it the whole grammar's reason is
    the answer."""
    for check in checks:
        why = await grammar_error(check.spec)
        if why is None:
            continue
        if not why.startswith(TOO_SLOW):  # one by one, a slow set would cost each its bound
            try:
                async with asyncio.timeout(budget_s):
                    for param, part in check.parts:
                        reason = await grammar_error(part)
                        if reason is not None:
                            raise ToolBadField(param, f"{param}: {reason}")
            except TimeoutError:
                pass
        raise ToolBadField(check.param, f"{check.param}: {why}")


def call_arguments(call: MessageToolCall, param: str) -> str:
    """A sent-back call's arguments as JSON text, checked to be JSON."""
    args = call.function.arguments
    if not isinstance(args, str):
        return json.dumps(args, ensure_ascii=False)
    try:
        json.loads(args or "{}")
    except ValueError as e:
        raise ToolBadField(param, f"{param} must be JSON text: {e}") from None
    except RecursionError:  # not a ValueError: json's own depth limit
        raise ToolBadField(param, f"{param} must be JSON text: it nests too deeply") from None
    return args or "{}"


def add_tools(tools: list[ToolDefinition], out) -> None:
    """OpenAI's tools as pagoda.v1 Tools (GenerateRequest's or TokenizeRequest's)."""
    for tool in tools:
        f = tool.function
        out.add(name=f.name, description=f.description or "", parameters=json.dumps(
            f.parameters, ensure_ascii=False) if f.parameters is not None else "")


def tool_request(body, req: pagoda_pb2.GenerateRequest,
                 structured: pagoda_pb2.StructuredOutput | None, config: ToolConfig
                 ) -> tuple[ToolMode | None, pagoda_pb2.StructuredOutput | None, list[ToolCheck]]:
    """Fills req.tools; returns how to read the answer, the request's structured output (the
    forced-call grammar, or the one given) and the grammars that must compile first
    (check_tools)."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice is not None:
            raise ToolBadField("tool_choice", "tool_choice is only allowed when tools are given")
        return None, structured, []
    if len(tools) > config.max_tools:  # before anything is built or compiled for them
        raise ToolBadField("tools", f"tools: {len(tools)} tools, at most {config.max_tools} are "
                                    "allowed (--max-tools)")
    functions = []
    for i, tool in enumerate(tools):
        f = tool.function
        name = f"tools[{i}].function.name"
        if not _NAME.fullmatch(f.name):
            raise ToolBadField(name, f"{name} must be 1 to 64 letters, digits, '_' or '-', "
                                     f"got {f.name[:80]!r}")
        if any(g["name"] == f.name for g in functions):
            raise ToolBadField(name, f"{name}: the function {f.name!r} is defined twice")
        params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        size = len(json.dumps(params, ensure_ascii=False).encode())
        param = f"tools[{i}].function.parameters"
        if size > config.max_spec_bytes:
            raise ToolBadField(param, f"{param} is {size} bytes, at most {config.max_spec_bytes} "
                                      "are allowed (--max-structured-output-bytes)")
        functions.append({"name": f.name, "parameters": params})
    choice = "auto" if choice is None else choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and all(f["name"] != named for f in functions):
        raise ToolBadField("tool_choice", f"tool_choice names the function {named!r}, which is "
                                          "not among tools")
    if not (choice == "none" and config.exclude_tools_when_none):
        add_tools(tools, req.tools)
    parallel = body.parallel_tool_calls is not False
    tag = tool_call_tag(functions, choice if named is None else _named(named), parallel)
    checks = []
    if tag is not None:
        if structured is not None:
            raise ToolBadField("tool_choice", f"tool_choice {named or choice!r} is enforced by a "
                                              "grammar and cannot be combined with "
                                              "response_format or structured_outputs")
        if len(tag.encode()) > config.max_spec_bytes:
            raise ToolBadField("tools", f"tools: the grammar for tool_choice {named or choice!r} "
                                        f"is {len(tag.encode())} bytes, at most "
                                        f"{config.max_spec_bytes} are allowed "
                                        "(--max-structured-output-bytes)")
        structured = pagoda_pb2.StructuredOutput(structural_tag=tag)
        checks.append(_forced_check(functions, named, tag))
    reader = FORCED_PARSER if tag is not None else None if choice == "none" else config.parser
    return ToolMode(reader, parallel, named), structured, checks


def _forced_check(functions: list[dict], named: str | None, tag: str) -> ToolCheck:
    """The forced call's grammar, compiled before the request runs. A named function's names its
    parameters; "required"'s is all of them as one grammar (one compile), each on its own only
    to name the one at fault when it does not compile."""
    params = [f"tools[{i}].function.parameters" for i in range(len(functions))]
    if named is not None:
        i = next(i for i, f in enumerate(functions) if f["name"] == named)
        return ToolCheck(params[i], _spec(tag))
    return ToolCheck("tools", _spec(tag), [
        (param, _spec(tool_call_tag([f], _named(f["name"]), True))) for param, f in zip(params, functions)])
