"""Prometheus metrics of the gateway, served at <--gateway-metrics-host>:<--gateway-metrics-port>/metrics
(127.0.0.1:9401 by default).

Defined once at import on the default registry: a second definition of the same name would
raise, and tests start several gateways in one process.
"""
from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from proto import internal_pb2

# Token latencies span ~1 ms (a cached decode step) to minutes (a long queue), hence wide buckets.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

REQUESTS = Counter("pagoda_gateway_requests_total",
                   "Finished RPCs by method and gRPC status code", ["method", "code"])
IN_FLIGHT = Gauge("pagoda_gateway_requests_in_flight", "Generate RPCs being served now")
TIME_TO_FIRST_TOKEN = Histogram("pagoda_gateway_time_to_first_token_seconds",
                                "From request arrival to the first token at the gateway", buckets=_LATENCY_BUCKETS)
# Per finished index: (last token - first token) / (output tokens - 1), as vLLM's TPOT.
TIME_PER_OUTPUT_TOKEN = Histogram("pagoda_gateway_time_per_output_token_seconds",
                                  "Mean time between output tokens of one finished sequence",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                                           0.2, 0.3, 0.5, 0.75, 1, 2.5, 5))
E2E_LATENCY = Histogram("pagoda_gateway_e2e_request_latency_seconds",
                        "From request arrival to its last message", ["method"], buckets=_LATENCY_BUCKETS)
TOKENS_STREAMED = Counter("pagoda_gateway_tokens_streamed_total", "Output tokens sent to clients")
PROMPT_TOKENS = Counter("pagoda_gateway_prompt_tokens_total", "Prompt tokens of accepted requests")
GRPC_CONNECTIONS = Gauge("pagoda_gateway_grpc_connections", "Open connections on the gRPC port")
GRPC_CONNECTIONS_REFUSED = Counter(
    "pagoda_gateway_grpc_connections_refused_total",
    "gRPC connections closed by the front (gateway/bounds/grpc_front.py): per_peer (the address had "
    "--max-grpc-connections-per-peer open), total (--max-grpc-connections full and the address "
    "held as many as any other), silent (no bytes within --grpc-handshake-timeout)", ["reason"])
GRPC_CONNECTIONS_EVICTED = Counter(
    "pagoda_gateway_grpc_connections_evicted_total",
    "gRPC connections closed to make room for a new one from an address holding fewer")
NUM_WORKERS = Gauge("pagoda_gateway_cluster_workers", "Workers the scheduler reports as ready")


def start_metrics_server(port: int, addr: str = "127.0.0.1"):
    """Serves /metrics from a daemon thread; returns the HTTP server (or None when port is 0)."""
    if port <= 0:
        return None
    server, _thread = start_http_server(port, addr=addr)
    return server


class ClusterGauges:
    """The public HTTP /metrics: only the cluster-level gauges request routers read, under vLLM's
    names (vllm:num_requests_waiting and _running, vllm:kv_cache_usage_perc: a fraction, as
    vLLM's), summed over the workers. No key is needed, as vLLM's needs none, so it names no
    worker and no tenant; the full registry stays on --gateway-metrics-port. One GetLoads call to
    the scheduler serves every scrape within max_age seconds, so scraping cannot load it."""

    def __init__(self, client, max_age: float = 1.0) -> None:
        self.client = client  # gateway/scheduler_link/scheduler_client.py SchedulerClient
        self.max_age = max_age
        self._page = b""
        self._at = float("-inf")
        self._asking: asyncio.Future | None = None

    async def page(self) -> bytes | None:
        """The page; None when the scheduler did not answer (the client's SchedulerUnavailable)."""
        if time.monotonic() - self._at > self.max_age:
            if self._asking is None:
                self._asking = asyncio.ensure_future(self._ask())
                self._asking.add_done_callback(self._asked)
            try:
                await asyncio.shield(self._asking)
            except RuntimeError:  # SchedulerUnavailable
                return None
        return self._page

    def _asked(self, future: asyncio.Future) -> None:
        self._asking = None
        if not future.cancelled():
            future.exception()  # retrieved: waiters that left early must not leave it unread

    async def _ask(self) -> None:
        loads = (await self.client.call(internal_pb2.Call(get_loads=True), timeout=2.0)).loads
        info = self.client.info
        model = info.model if info is not None else ""
        used = sum(w.kv_blocks_used for w in loads.workers)
        total = sum(w.kv_blocks_total for w in loads.workers)
        registry = CollectorRegistry(auto_describe=False)
        for name, doc, value in [
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 sum(w.running for w in loads.workers)),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 loads.num_pending + sum(w.waiting for w in loads.workers)),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 used / total if total else 0.0)]:
            Gauge(name, doc, ["model_name"], registry=registry).labels(model).set(value)
        self._page = generate_latest(registry)
        self._at = time.monotonic()
