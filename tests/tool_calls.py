"""What the function-calling tests (the real model's and the canned fake worker's) send back and
read: a conversation that goes on after a tool call, and how the gateway renders it."""
from __future__ import annotations

import httpx2 as httpx


def after_a_call(ask: list[dict], call_id: str, name: str, arguments: str, result: str) -> list[dict]:
    """ask, then the assistant's one call of `name` with `arguments` (JSON text), then the tool's
    result."""
    return ask + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result}]


def rendered(base_url: str, body: dict) -> tuple[list[int], str]:
    """The prompt the gateway renders for a chat request body: its tokens (/tokenize) and their
    text (/detokenize). base_url: the OpenAI-compatible API's, ending in /v1."""
    root = base_url.removesuffix("/v1")
    tokens = httpx.post(f"{root}/tokenize", timeout=30, json=body).json()["tokens"]
    return tokens, httpx.post(f"{root}/detokenize", timeout=30, json={"tokens": tokens}).json()["prompt"]
