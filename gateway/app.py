"""Assembles one gateway: the gRPC server (Generation, Health, reflection), the OpenAI-compatible
HTTP server (gateway/rest/http_server.py) and their shared scheduler link.

Kept apart from main.py so tests can run a whole gateway inside their own event loop on an
ephemeral port.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway import metrics
from gateway.bounds.call_bounds import CallBounds, CallSlots
from gateway.bounds.client_auth import ApiKeyInterceptor, server_credentials
from gateway.bounds.edge import EdgeConfig
from gateway.bounds.grpc_bounds import RequestSizeInterceptor
from gateway.bounds.grpc_front import GrpcFront
from gateway.rest.http_listener import HttpServer
from gateway.rest.http_server import HttpApi
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.generation.server import GenerationServicer
from gateway.tokenizer import TextTokenizer
from gateway.validation.limits import Limits
from proto import internal_pb2, pagoda_pb2, pagoda_pb2_grpc

log = logging.getLogger("pagoda.gateway")

SERVICE_NAME = pagoda_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_HEALTH_NAMES = ("", SERVICE_NAME)  # readiness: a scheduler answers and has a worker (and warm: below)
# Liveness: SERVING for as long as this process answers, whatever the scheduler does, so that an
# orchestrator's liveness probe does not restart every gateway during a scheduler outage (the
# readiness names above take them out of the load balancer instead). NOT_SERVING only once
# draining after SIGTERM.
LIVENESS_SERVICE = "liveness"


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Gateway:
    def __init__(self, tokenizer: TextTokenizer, scheduler_address: str, host: str = "127.0.0.1",
                 port: int = 50051, max_message_bytes: int = 16 << 20,
                 client: SchedulerClient | None = None, limits: Limits | None = None,
                 http_port: int = 0, max_http_body_bytes: int = 1 << 20,
                 max_concurrent_rpcs: int | None = None, max_request_bytes: int | None = None,
                 keys_dir: str | None = None, api_keys: tuple[str, ...] = (),
                 ssl: tuple[str, str] | None = None, max_response_bytes: int | None = None,
                 edge: EdgeConfig = EdgeConfig(), warm_grammar: bool = False):
        self.tokenizer = tokenizer
        self.host = host
        # Start the structured-output check's compiler once a worker is up (gateway.main does,
        # unless --structured-outputs-lazy): in-process test gateways do without its child.
        self.warm_grammar = warm_grammar
        self.port = port
        self.client = client or SchedulerClient(scheduler_address, max_message_bytes,
                                                keys_dir=keys_dir, model=tokenizer.name)
        self.health = health.aio.HealthServicer()
        self.ssl = ssl  # (certfile, keyfile): TLS on the gRPC port
        # The public gRPC port is the front's: it bounds connections per address and in total
        # and splices them to the grpc server's private port (gateway/bounds/grpc_front.py).
        self.front = GrpcFront(host, port, edge.max_grpc_connections,
                               edge.max_grpc_connections_per_peer, edge.grpc_handshake_timeout)
        # Outermost first: a call without a key is refused before it takes a slot. The bound
        # on calls is CallBounds', not grpc.aio's maximum_concurrent_rpcs, which counts health.
        self.slots = CallSlots(max_concurrent_rpcs, edge.max_rpcs_per_peer)
        interceptors = ([ApiKeyInterceptor(api_keys)] if api_keys else []) + [
            CallBounds(self.slots, edge.grpc_first_message_timeout, self.front.client_host),
            # Innermost: its deserializer refuses a request larger than the largest valid one
            # for the context the scheduler announced, before protobuf parses it.
            RequestSizeInterceptor(limits or Limits(max_model_len=0, vocab_size=0),
                                   lambda: self.client.info.max_model_len if self.client.info else 0)]
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", max_request_bytes or max_message_bytes),
            # The largest valid response (gateway/bounds/grpc_bounds.py largest_response), from main.py.
            ("grpc.max_send_message_length", max_response_bytes or max_message_bytes),
            # Without this a second gateway on the same port would silently share it.
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", edge.max_streams_per_connection),
            # No grpc.max_allowed_incoming_connections: it was global and taken before any key;
            # the front bounds connections now, per address and in total.
            ("grpc.max_connection_age_ms", int(edge.max_connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", int(edge.max_connection_age_grace * 1000)),
            ("grpc.max_connection_idle_ms", int(edge.grpc_max_connection_idle * 1000)),
            # From the front's connect, made once the client sent its first bytes.
            ("grpc.server_handshake_timeout_ms", int(edge.grpc_handshake_timeout * 1000)),
        ])
        self.edge = edge
        self.servicer = GenerationServicer(tokenizer, self.client, limits, api_keys, edge=edge,
                                           client_host=self.front.client_host)
        pagoda_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        # OpenAI-compatible HTTP on the same host and loop (0 = off), behind the same keys.
        self.http_port = http_port
        self.http = HttpServer(HttpApi(self.servicer, max_http_body_bytes, edge), host,
                               http_port, edge, ssl) if http_port else None
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.client.add_info_listener(self._on_cluster_info)
        self._warned_model = ""
        self._workers = 0  # the scheduler's last count
        self._awaiting_warmth = False  # readiness waits for the grammar check's child

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port (useful with port 0)."""
        # The grpc server's own port: 127.0.0.1 only, so that no other host can reach it past
        # the front's bounds (a process on this host that connects to it is logged by the
        # front's client_host, and its calls count against 127.0.0.1).
        private = _bind_address("127.0.0.1", 0)
        upstream = (self.server.add_secure_port(private, server_credentials(*self.ssl)) if self.ssl
                    else self.server.add_insecure_port(private))
        if not upstream:
            raise OSError(f"cannot bind the gateway's private gRPC port on {private}")
        try:
            bound = self.port = await self.front.bind()
        except OSError as e:
            raise OSError(f"cannot bind the gateway to {_bind_address(self.host, self.port)}: "
                          f"{e}") from e
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if self.warm_grammar:
            self.servicer.spawn_grammar()
        await self.client.start()
        await self.server.start()
        await self.front.serve(upstream)
        if self.http is not None:
            self.http_port = await self.http.start()
        log.info("gateway serving %s on %s:%d (gRPC)%s (scheduler %s)", self.tokenizer.name,
                 self.host, bound, f" and :{self.http_port} (HTTP)" if self.http else "",
                 self.client.address)
        return bound

    async def stop(self, grace: float | None = 5.0) -> None:
        # Tell load balancers first, then let RPCs in flight finish (their finally blocks still
        # need the scheduler socket to send aborts), then close the socket.
        # One drain: HTTP and gRPC streams get the same grace, side by side.
        await self.health.enter_graceful_shutdown()
        self.front.stop_accepting()  # as grpc's own listener did at server.stop
        drains = [self.server.stop(grace)]
        if self.http is not None:
            drains.append(self.http.stop(grace))
        await asyncio.gather(*drains)
        self.front.close()  # the connections that never became calls
        await self.client.close()
        await self.servicer.close()  # the grammar compiler child, if one was started

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def _on_cluster_info(self, info: internal_pb2.ClusterInfo | None) -> None:
        workers = info.num_workers if info is not None else 0
        metrics.NUM_WORKERS.set(workers)
        if info is not None and info.model not in ("", self.tokenizer.name, self._warned_model):
            self._warned_model = info.model  # once per model, not on every keepalive answer
            log.warning("the scheduler serves %r but this gateway tokenizes for %r",
                        info.model, self.tokenizer.name)
        self._workers = workers
        if workers >= 1 and self.warm_grammar:
            warming = self.servicer.warm_grammar()
            if warming is not None and not warming.done():
                # Ready once the grammar check's child is warm, not before: its start (2.7 s of
                # CPU for SmolLM2 on a 2-core Zen 2) took the CPU from the first request's prefill,
                # 2.3 s to the first token instead of 0.6. Its own start timeout bounds the wait.
                if not self._awaiting_warmth:
                    self._awaiting_warmth = True
                    warming.add_done_callback(self._warmed)
                workers = 0
        await self._set_health(workers >= 1)

    def _warmed(self, _task: asyncio.Future) -> None:
        asyncio.ensure_future(self._set_health(self._workers >= 1))

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in _HEALTH_NAMES:
            await self.health.set(name, status)
