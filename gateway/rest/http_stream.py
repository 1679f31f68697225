"""The HTTP API's answers from a request's responses: a whole one, or server-sent events as
OpenAI streams them (chat chunks, with tool-call deltas when the request has tools; completions
chunks, each prompt's echo first)."""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator

from gateway.rest.http_errors import from_rpc
from gateway.rest.openai_render import Collector, chat_delta, chat_logprobs, chunk, finish_reason
from gateway.statuses import RpcFailed
from gateway.rest.tool_render import ToolStream


async def whole(gen, first, collector: Collector, rid: str, created: int, model: str,
                chat: bool) -> dict:
    async with aclosing(gen):
        item = first
        while item is not None:
            collector.add(*item)
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                item = None
            except RpcFailed as e:
                raise from_rpc(e, chat) from None
    return collector.response(rid, model, created)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _tool_choices(index: int, stream: ToolStream, response, lps) -> list[dict]:
    """A response's chat choices when the request has tools: its deltas (the first carries the
    logprobs), then the finish in a delta of its own, as OpenAI sends it."""
    deltas = stream.deltas(response.text)
    finish = finish_reason(response)
    if finish is not None:
        more, finish = stream.finish(finish)
        deltas += more
    if not deltas and lps is not None:
        deltas = [{}]
    out = [{"index": index, "delta": d, "logprobs": {"content": lps} if k == 0 and lps is not None
            else None, "finish_reason": None} for k, d in enumerate(deltas)]
    if finish is not None:
        out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
    return out


async def events(gen, first, collector: Collector, rid: str, created: int, model: str, chat: bool,
                 include_usage: bool) -> AsyncIterator[str]:
    waiting: dict[int, list] = {}  # prompt -> responses held until its echo is complete
    sent: dict[int, int] = {}      # choice -> logprob entries sent
    tools: dict[int, ToolStream] = {}  # choice -> its tool-call parsing

    def completion_chunk(i: int, response) -> dict:
        index = i * collector.n + response.index
        choice = collector.choices[index]
        text = response.text
        if not choice.echoed:
            choice.echoed = True
            text = collector.echo_part(i)[0] + text
        start = sent.get(index, 0)
        sent[index] = start + len(response.logprobs)
        return {"index": index, "text": text, "finish_reason": finish_reason(response),
                "logprobs": collector.completion_logprobs(index, start, sent[index])}

    async with aclosing(gen):
        item = first
        try:
            while item is not None:
                i, response = item
                collector.add(i, response)
                if chat:
                    index = i * collector.n + response.index
                    if not collector.choices[index].echoed:
                        # The first chunk names the role of every choice, in index order: the
                        # SDK's stream accumulator numbers choices as it first meets them.
                        for c in collector.choices:
                            c.echoed = True
                        yield _event(chunk(rid, model, created, True, [
                            chat_delta(k, "", None, None, role=True)
                            for k in range(len(collector.choices))]))
                    lps = (chat_logprobs(response.logprobs, collector.tokenizer)
                           if collector.logprobs else None)
                    if collector.tools is None:
                        yield _event(chunk(rid, model, created, True, [chat_delta(
                            index, response.text, lps, finish_reason(response))]))
                    else:
                        stream = tools.setdefault(index, ToolStream(collector.tools))
                        for choice in _tool_choices(index, stream, response, lps):
                            yield _event(chunk(rid, model, created, True, [choice]))
                elif not collector.echo_ready(i):
                    waiting.setdefault(i, []).append(response)
                else:
                    for r in waiting.pop(i, []) + [response]:
                        yield _event(chunk(rid, model, created, False, [completion_chunk(i, r)]))
                item = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except RpcFailed as e:
            yield _event(from_rpc(e, chat).body())
        if include_usage:
            yield _event(chunk(rid, model, created, chat, [], collector.usage()))
        yield "data: [DONE]\n\n"
