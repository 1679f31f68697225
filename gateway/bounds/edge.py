"""The public edge's limits on connections and time (the gateway's flags), in one place for the
gRPC and HTTP servers. Each keeps one client from holding what other clients need: a slot, a
connection, or the gateway's memory."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EdgeConfig:
    max_batch_prompts: int = 256          # prompts in one /v1/completions batch
    shared_prefix_cache: bool = False     # tenants share prefix-cache blocks
    max_streams_per_connection: int = 1024  # gRPC: HTTP/2 streams one connection may hold
    max_http_connections: int = 1024      # HTTP connections with a key (all, without keys); 503
    max_http_unauthenticated_connections: int = 256  # before a key: the oldest idle is closed
    max_http_connections_per_key: int = 512    # HTTP connections of one tenant; past it, 429
    max_http_connections_per_peer: int = 256   # HTTP connections of one address; past it, closed
    trusted_proxies: tuple[str, ...] = ()      # whose X-Forwarded-For names the peer
    max_http_header_bytes: int = 64 << 10      # a request's head (request line too); past it, 431
    max_http_headers: int = 100                # headers of one request; past it, 431
    max_grpc_connections: int = 1024      # open gRPC connections; past it, the biggest holder's go
    max_grpc_connections_per_peer: int = 64  # gRPC connections of one address; past it, closed
    # A gRPC call whose client reads nothing cannot be cancelled from grpc.aio (its status
    # queues behind the unread messages), so a connection's age is what bounds how long it can
    # hold its RPC slots: past age it gets GOAWAY, past age + grace it is closed.
    max_connection_age: float = 1800.0
    max_connection_age_grace: float = 600.0
    max_rpcs_per_peer: int = 256          # Generation calls in flight from one client address
    grpc_first_message_timeout: float = 5.0  # from a call's headers to its request message
    grpc_max_connection_idle: float = 300.0  # a connection without calls this long is closed
    grpc_handshake_timeout: float = 10.0  # from connect to TLS and HTTP/2 settings done
    http_header_timeout: float = 10.0     # from connect (or the last response) to whole headers
    http_body_timeout: float = 30.0       # to read a whole request body
    http_write_timeout: float = 30.0      # a client that reads nothing this long is hung up on
    shutdown_grace_period: float = 30.0   # one drain, for HTTP and gRPC alike
    max_grammar_compile_seconds: float = 5.0   # a structured-output spec slower to compile: 400
    structured_check_processes: int = 2   # compiler children: a slow spec holds only one
    max_grammar_queue_seconds: float = 10.0  # a spec's wait for a compiler child: past it, 429
    structured_outputs_any_whitespace: bool = False  # HTTP's default for JSON whitespace
    tool_call_parser: str = "hermes"      # reads "auto" tool calls out of the text
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": tools not rendered
    tenant_priority: tuple[str, ...] = ()  # KEY=LO:HI grants (client_auth.py priority_ranges)
    default_tenant_priority: str | None = None  # LO:HI for every other tenant

    @classmethod
    def from_args(cls, args) -> "EdgeConfig":
        """From the gateway's parsed flags; a flag the namespace lacks keeps its default."""
        values = {name: getattr(args, name, default) for name, default in cls().__dict__.items()}
        values["tenant_priority"] = tuple(values["tenant_priority"] or ())
        values["trusted_proxies"] = tuple(values["trusted_proxies"] or ())
        return cls(**values)
