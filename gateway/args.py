"""The gateway's command-line flags.

The launcher routes each flag to the process whose parser knows it, so these names belong to the
gateway alone (except --model, which the worker shares: both must read the same model). Limits
that belong to the model or the cache (max_model_len, block_size, vocab size, the number of
workers) are not flags here: the gateway learns them from the scheduler's ClusterInfo, so they
can never disagree with what the workers actually run.
"""
from __future__ import annotations

import argparse

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the same default as the scheduler's and workers'.


def add_gateway_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("gateway")
    g.add_argument("--model", default="",
                   help="a .gguf file or a HF directory with tokenizer.json; "
                        "empty = SmolLM2-135M-Instruct (default: %(default)r)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC server binds; loopback unless told (default: %(default)s)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (default: %(default)s)")
    g.add_argument("--scheduler-gateway-address", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ address of the scheduler's gateway socket (default: %(default)s)")
    g.add_argument("--gateway-metrics-host", default="127.0.0.1",
                   help="address /metrics binds; a container needs 0.0.0.0 (default: %(default)s)")
    g.add_argument("--gateway-metrics-port", type=int, default=9401,
                   help="Prometheus /metrics port, 0 = off (default: %(default)s)")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest gRPC or ZeroMQ message sent or received (default: %(default)s)")
    g.add_argument("--log-level", default="INFO")
    return parser


def parse_gateway_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.main",
                                     description="pagoda gateway: gRPC in, ZeroMQ to the scheduler")
    return add_gateway_args(parser).parse_args(argv)
