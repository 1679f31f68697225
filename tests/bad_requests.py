"""Malformed pagoda.v1.GenerateRequests, each with the field its error message must name.

Shared by the validation unit test and the end-to-end gRPC test, so that both layers refuse the
same inputs in the same words. Written against SmolLM2 (vocab_size 49152, max_model_len 8192) and
the gateway's default limits (gateway/gateway_flags.py REQUEST_LIMITS).

A case is (spec, field): spec is a dict in protobuf's JSON mapping (json_format.ParseDict, or
grpcurl -d after json.dumps; NaN and infinities are the strings "NaN" and "Infinity"), or a
function returning one, for inputs too large to keep in memory for the whole session.
"""
from __future__ import annotations

from typing import Callable, Union

from google.protobuf import json_format

from proto import pagoda_pb2 as pb

VOCAB_SIZE = 49152
MAX_MODEL_LEN = 8192
PROMPT = "Hello"

Spec = Union[dict, Callable[[], dict]]


def _req(sampling: dict | None = None, stopping: dict | None = None, **top) -> dict:
    """A request that is valid but for what the arguments add; the prompt unless told otherwise."""
    out = top if {"prompt", "prompt_token_ids", "messages"} & top.keys() else {"prompt": PROMPT, **top}
    if sampling is not None:
        out["sampling"] = sampling
    if stopping is not None:
        out["stopping"] = stopping
    return out


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


BAD_REQUESTS: list[tuple[Spec, str]] = [
    # Which prompt field: exactly one.
    ({}, "prompt"),  # so is {"prompt": ""}: proto3 sends the two as the same bytes
    ({"prompt": PROMPT, "prompt_token_ids": [1, 2]}, "prompt_token_ids"),
    ({"prompt": PROMPT, "messages": _user("hi")}, "messages"),
    ({"prompt_token_ids": [1, 2], "messages": _user("hi")}, "messages"),
    # The prompt itself.
    ({"prompt_token_ids": [1, VOCAB_SIZE]}, "prompt_token_ids[1]"),
    ({"prompt_token_ids": [4294967295]}, "prompt_token_ids[0]"),
    ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, "prompt_token_ids"),
    ({"prompt": "word " * 9000}, "prompt"),                    # ~9000 tokens > 8191
    (lambda: {"prompt": "word " * 2_000_000}, "prompt"),       # 10 MB: refused untokenized
    (lambda: {"messages": _user("x" * 300_000)}, "messages"),  # > 8192 * 32 characters
    (_req(prompt_token_ids=[5] * 9000, truncate_prompt_tokens=8192), "prompt_token_ids"),
    (_req(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (_req(truncate_prompt_tokens=-3), "truncate_prompt_tokens"),
    # Chat messages.
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": _user("hi") + [{"role": "", "content": "x"}]}, "messages[1].role"),
    ({"messages": _user("hi") * 257}, "messages"),
    # Request metadata.
    (_req(request_id="r" * 257), "request_id"),
    (_req(request_id="é" * 129), "request_id"),  # 129 characters, 258 bytes
    (_req(request_id="line\nbreak"), "request_id"),
    (_req(request_id="nul\x00"), "request_id"),
    (_req(priority=1_000_001), "priority"),
    (_req(priority=-1_000_001), "priority"),
    # Sampling.
    (_req(sampling={"temperature": "NaN"}), "sampling.temperature"),
    (_req(sampling={"temperature": "Infinity"}), "sampling.temperature"),
    (_req(sampling={"temperature": -0.5}), "sampling.temperature"),
    (_req(sampling={"top_p": 0}), "sampling.top_p"),
    (_req(sampling={"top_p": 1.5}), "sampling.top_p"),
    (_req(sampling={"top_p": "NaN"}), "sampling.top_p"),
    (_req(sampling={"top_k": -1}), "sampling.top_k"),
    (_req(sampling={"n": 0}), "sampling.n"),
    (_req(sampling={"n": 17}), "sampling.n"),
    (_req(sampling={"min_p": 1.5}), "sampling.min_p"),
    (_req(sampling={"min_p": -0.1}), "sampling.min_p"),
    (_req(sampling={"min_p": "NaN"}), "sampling.min_p"),
    (_req(sampling={"presence_penalty": 3}), "sampling.presence_penalty"),
    (_req(sampling={"presence_penalty": "-Infinity"}), "sampling.presence_penalty"),
    (_req(sampling={"frequency_penalty": -2.5}), "sampling.frequency_penalty"),
    (_req(sampling={"frequency_penalty": "NaN"}), "sampling.frequency_penalty"),
    (_req(sampling={"repetition_penalty": 0}), "sampling.repetition_penalty"),
    (_req(sampling={"repetition_penalty": -1}), "sampling.repetition_penalty"),
    (_req(sampling={"repetition_penalty": "Infinity"}), "sampling.repetition_penalty"),
    (_req(sampling={"repetition_penalty": "NaN"}), "sampling.repetition_penalty"),
    (_req(sampling={"logit_bias": {str(VOCAB_SIZE): 1.0}}), "sampling.logit_bias"),
    (_req(sampling={"logit_bias": {"5": 1e9}}), "sampling.logit_bias"),
    (_req(sampling={"logit_bias": {"5": -100.5}}), "sampling.logit_bias"),
    (_req(sampling={"logit_bias": {"5": "NaN"}}), "sampling.logit_bias"),
    (_req(sampling={"logit_bias": {str(i): 1.0 for i in range(1025)}}), "sampling.logit_bias"),
    (_req(sampling={"logprobs": 21}), "sampling.logprobs"),
    (_req(sampling={"logprobs": -1}), "sampling.logprobs"),
    (_req(sampling={"prompt_logprobs": -1}), "sampling.prompt_logprobs"),
    (_req(sampling={"prompt_logprobs": 21}), "sampling.prompt_logprobs"),
    # Stopping.
    (_req(stopping={"max_tokens": -1}), "stopping.max_tokens"),
    (_req(stopping={"max_tokens": 0}), "stopping.max_tokens"),
    (_req(stopping={"max_tokens": MAX_MODEL_LEN}), "stopping.max_tokens"),  # prompt + it > 8192
    (_req(stopping={"min_tokens": -1}), "stopping.min_tokens"),
    (_req(stopping={"max_tokens": 10, "min_tokens": 20}), "stopping.min_tokens"),
    (_req(stopping={"stop": [f"s{i}" for i in range(17)]}), "stopping.stop"),
    (_req(stopping={"stop": ["x" * 300]}), "stopping.stop[0]"),
    (_req(stopping={"stop": ["é" * 129]}), "stopping.stop[0]"),  # 258 bytes
    (_req(stopping={"stop": ["ok", ""]}), "stopping.stop[1]"),
    (_req(stopping={"stop_token_ids": list(range(65))}), "stopping.stop_token_ids"),
    (_req(stopping={"stop_token_ids": [2, VOCAB_SIZE]}), "stopping.stop_token_ids[1]"),
]


def spec(case) -> dict:
    """The case's request as a JSON-mapping dict (what grpcurl -d takes after json.dumps)."""
    s = case[0]
    return s() if callable(s) else s


def build(case) -> pb.GenerateRequest:
    return json_format.ParseDict(spec(case), pb.GenerateRequest())


def case_id(i: int, case) -> str:
    """A readable pytest id: the position and the field."""
    return f"{i}-{case[1]}"
