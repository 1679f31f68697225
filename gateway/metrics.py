"""Prometheus metrics of the gateway, served at <--gateway-metrics-host>:<--gateway-metrics-port>/metrics
(127.0.0.1:9401 by default).

Defined once at import on the default registry: a second definition of the same name would
raise, and tests start several gateways in one process.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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
NUM_WORKERS = Gauge("pagoda_gateway_cluster_workers", "Workers the scheduler reports as ready")


def start_metrics_server(port: int, addr: str = "127.0.0.1"):
    """Serves /metrics from a daemon thread; returns the HTTP server (or None when port is 0)."""
    if port <= 0:
        return None
    server, _thread = start_http_server(port, addr=addr)
    return server
