"""What one gRPC call may hold before it has sent its request: a slot of the Generation service
(bounded per peer and in total) for at most --grpc-first-message-timeout seconds.

grpc.aio's own bound (maximum_concurrent_rpcs) counts every call, health included, and a call
holds its slot from its headers on: one client that opened calls and never sent their messages
took every slot, and the liveness probe failed. So the bound lives here instead, in a wrapper
around the Generation handlers, and health and reflection are never counted.

Each wrapped handler is registered request-streaming (the wire format of a unary request is the
same), so it runs as soon as the call's headers are read: it takes a slot (RESOURCE_EXHAUSTED
past the peer's or the total), reads the one request message within the deadline
(DEADLINE_EXCEEDED past it) and then runs the handler it wraps unchanged. The slot is freed when
grpc.aio is done with the call, not when the handler returns: a stream whose client reads
nothing keeps its call (and its queued messages) until the connection's age ends it, and keeps
its slot as long, as under grpc.aio's own bound. Every other call (health's, reflection's) takes
no slot but gets its first request message within the same deadline.
"""
from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError

from proto import pagoda_pb2

GENERATION_PREFIX = "/" + pagoda_pb2.DESCRIPTOR.services_by_name["Generation"].full_name + "/"


def peer_host(peer: str) -> str:
    """The client's address without its port: "ipv4:10.0.0.7:5123" -> "10.0.0.7",
    "ipv6:[::1]:5123" (percent-encoded or not) -> "::1"; anything else (unix:...) as it is."""
    peer = unquote(peer)
    scheme, _, address = peer.partition(":")
    if scheme == "ipv4":
        return address.rpartition(":")[0] or address
    if scheme == "ipv6":
        host = address.rpartition(":")[0] if address.startswith("[") else address
        return host.strip("[]")
    return peer


class CallSlots:
    """Calls in flight, per peer and in total (None: no total bound)."""

    def __init__(self, total: int | None, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.in_flight = 0
        self.by_peer: Counter[str] = Counter()

    def take(self, host: str) -> str | None:
        """Takes a slot for a call from `host`; else the refusal's message."""
        if self.by_peer[host] >= self.per_peer:
            return (f"this client ({host}) has {self.per_peer} calls in flight, the most one "
                    f"address may have (--max-rpcs-per-peer); retry once one has ended")
        if self.total is not None and self.in_flight >= self.total:
            return (f"the gateway has {self.total} calls in flight, the most it serves at once "
                    f"(--max-concurrent-rpcs); retry later")
        self.in_flight += 1
        self.by_peer[host] += 1
        return None

    def give_back(self, host: str) -> None:
        self.in_flight -= 1
        self.by_peer[host] -= 1
        if not self.by_peer[host]:
            del self.by_peer[host]  # the table holds only peers with calls in flight


class CallBounds(grpc.aio.ServerInterceptor):
    """Wraps every (async) handler: Generation's take a slot, and every call, health's and
    reflection's too, gets its first request message within `first_message_timeout` seconds."""

    def __init__(self, slots: CallSlots, first_message_timeout: float,
                 client_host: Callable[[str], str] = peer_host) -> None:
        self.slots = slots
        self.timeout = first_message_timeout
        self.client_host = client_host  # context.peer() -> the client's address
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not _is_async(handler):
            return handler  # unknown method (UNIMPLEMENTED), or a sync handler: none here
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            slots = self.slots if details.method.startswith(GENERATION_PREFIX) else None
            wrapped = self._wrapped[details.method] = (
                first_of_stream(handler, self.timeout) if handler.request_streaming
                else bounded(handler, slots, self.timeout, self.client_host))
        return wrapped


def _behaviour(handler: grpc.RpcMethodHandler):
    return {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
            (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
        (handler.request_streaming, handler.response_streaming)]


def _is_async(handler: grpc.RpcMethodHandler) -> bool:
    behaviour = _behaviour(handler)
    return inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)


def _deadline_exceeded(timeout: float) -> str:
    return (f"no request message within {timeout:g} s of the call's headers "
            f"(--grpc-first-message-timeout)")


def bounded(handler: grpc.RpcMethodHandler, slots: CallSlots | None, timeout: float,
            client_host: Callable[[str], str] = peer_host) -> grpc.RpcMethodHandler:
    """`handler` (unary request) as a request-streaming handler that takes a slot of `slots`
    (None: none) for the client `client_host` names, and waits at most `timeout` seconds for
    the request."""
    behaviour = _behaviour(handler)

    async def first_request(requests, context):
        if slots is not None:
            host = client_host(context.peer())
            refusal = slots.take(host)
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            context.add_done_callback(lambda _context: slots.give_back(host))
        try:
            request = await asyncio.wait_for(context.read(), timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _deadline_exceeded(timeout))
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request: not a valid protobuf message of this method's type")
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request: the call ended without its request message")
        return request

    if not handler.response_streaming:
        async def unary(requests, context):
            return await behaviour(await first_request(requests, context), context)
        return grpc.stream_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)

    if inspect.isasyncgenfunction(behaviour):
        async def stream(requests, context):
            request = await first_request(requests, context)
            # aclosing: a cancel at this `yield` closes the handler's generator now, as it was
            # when grpc.aio iterated it itself.
            async with aclosing(behaviour(request, context)) as responses:
                async for response in responses:
                    yield response
    else:  # a coroutine that writes with context.write
        async def stream(requests, context):
            await behaviour(await first_request(requests, context), context)
    return grpc.stream_stream_rpc_method_handler(
        stream, handler.request_deserializer, handler.response_serializer)


def first_of_stream(handler: grpc.RpcMethodHandler, timeout: float) -> grpc.RpcMethodHandler:
    """A request-streaming `handler` that gets its first message within `timeout` seconds (the
    ones after it may take their time: the client has shown it speaks gRPC)."""
    behaviour = _behaviour(handler)

    async def requests_of(requests, context):
        try:
            first = await asyncio.wait_for(anext(requests), timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _deadline_exceeded(timeout))
        except StopAsyncIteration:
            return
        yield first
        async for request in requests:
            yield request

    if not handler.response_streaming:
        async def unary(requests, context):
            return await behaviour(requests_of(requests, context), context)
        return grpc.stream_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)

    if inspect.isasyncgenfunction(behaviour):
        async def stream(requests, context):
            async with aclosing(behaviour(requests_of(requests, context), context)) as responses:
                async for response in responses:
                    yield response
    else:
        async def stream(requests, context):
            await behaviour(requests_of(requests, context), context)
    return grpc.stream_stream_rpc_method_handler(
        stream, handler.request_deserializer, handler.response_serializer)
