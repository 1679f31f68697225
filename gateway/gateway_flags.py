"""The gateway's command-line flags.

The launcher routes each flag to the process whose parser knows it, so these names belong to the
gateway alone (except --model, which the worker shares: both must read the same model). Limits
that belong to the model or the cache (max_model_len, block_size, vocab size, the number of
workers) are not flags here: the gateway learns them from the scheduler's ClusterInfo, so they
can never disagree with what the workers actually run.
"""
from __future__ import annotations

import argparse

from gateway.chat.chat_templates import TemplateFlagError, read_chat_template
from gateway.bounds.client_auth import api_keys_from, parse_range, priority_ranges, tenant_of_key
from gateway.bounds.http_pools import cidr
from gateway.validation.structured_check import MAX_CHOICES
from gateway.chat.tool_parsers import PARSERS
from process_life.flag_types import COUNT, PORT, POSITIVE_SECONDS, SECONDS, int_at_least
from proto.auth import add_auth_args
from proto.sizes import MAX_ID_BYTES, MAX_LIST, MAX_LOGPROBS, MAX_STRUCTURED_OUTPUT

# Bounds on one GenerateRequest (gateway.validation.validate.Limits has a field per entry, same name and
# default). Each keeps a single request from costing the gateway or a batch shared with other
# users more than it can justify; past one, the request gets INVALID_ARGUMENT naming the field.
# (dest, default, smallest value, help)
REQUEST_LIMITS: tuple[tuple[str, int, int, str], ...] = (
    ("max_stop_strings", 16, 0, "stop strings per request (stopping.stop)"),
    ("max_stop_string_bytes", 256, 1, "UTF-8 bytes of one stop string"),
    ("max_stop_token_ids", 64, 0, "entries of stopping.stop_token_ids"),
    ("max_messages", 256, 1, "chat messages per request"),
    ("max_logit_bias", 1024, 0, "entries of sampling.logit_bias"),
    ("max_request_id_bytes", 256, 1, "UTF-8 bytes of a client's request_id"),
    ("max_priority", 1_000_000, 0, "largest |priority|"),
    ("max_logprobs", 20, 0, "largest sampling.logprobs and sampling.prompt_logprobs (as vLLM's)"),
    ("max_structured_output_bytes", 32 << 10, 1,
     "bytes of sampling.structured_output (a JSON schema, regex, grammar or the choices)"),
    ("max_tools", 128, 0, "function definitions in one request's tools"),
    ("max_tool_calls", 256, 0,
     "tool calls in one request's messages (the assistant turns' tool_calls, all together)"),
    ("max_prompt_chars_per_token", 32, 1,
     "a prompt (or the chat messages' content) longer than max_model_len times this many "
     "characters is refused before it is tokenized"),
    ("max_tokenize_contexts", 2, 1,
     "a Tokenize answer holds at most max_model_len times this many tokens: a longer prompt "
     "gets INVALID_ARGUMENT (HTTP 400) naming it, found while it is encoded in pieces"),
    ("max_large_input_jobs", 2, 1,
     "requests over 32 KiB tokenized, rendered, decoded or answered (Tokenize) at once, each on "
     "a thread of their own so the event loop stays free; more wait their turn"),
    ("max_large_input_bytes", 1 << 19, 1 << 15,
     "bytes of such requests in work at once (tokenizing costs up to about 250 bytes of memory "
     "per input byte); a larger one runs alone"),
    ("large_input_wait_seconds", 5, 0,
     "how long such a request waits for its turn; then RESOURCE_EXHAUSTED (HTTP 429)"),
    ("max_whole_answer_bytes", 24 << 20, 1 << 16,
     "bytes of memory one whole answer with logprobs (unary Generate, HTTP not streamed) may "
     "keep, counted as 6 per byte of its wire size (about 8,000 tokens with 20 logprobs); past "
     "it the request ends with RESOURCE_EXHAUSTED (stream it instead)"),
    ("max_whole_answers_bytes", 64 << 20, 1 << 16,
     "bytes of memory all whole answers with logprobs on this gateway may reserve at once (each "
     "what it can grow to, at most --max-whole-answer-bytes); one that does not fit gets "
     "RESOURCE_EXHAUSTED (HTTP 429)"),
)

# The most each of those flags may be: what the scheduler takes (scheduler/message_checks.py) and
# its frame limit counts (proto/sizes.py). Past one, requests the gateway passes would be refused
# there, or make frames that ZeroMQ answers by dropping the gateway's connection.
REQUEST_CEILINGS: dict[str, int] = {
    "max_stop_token_ids": MAX_LIST,
    "max_logit_bias": MAX_LIST,
    "max_request_id_bytes": MAX_ID_BYTES - len(tenant_of_key("")),  # a tenant prefixes each id
    "max_logprobs": MAX_LOGPROBS,
    "max_structured_output_bytes": MAX_STRUCTURED_OUTPUT - 3 * MAX_CHOICES,  # choices' framing
}


def _chat_template(value: str) -> str:
    """--chat-template's text, read and parsed here so that a bad one stops the start."""
    try:
        return read_chat_template(value)
    except TemplateFlagError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_chat_template.__name__ = "chat template"


def _cidrs(value: str) -> list[str]:
    try:
        return [cidr(part) for part in value.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_cidrs.__name__ = "CIDR list"


def add_gateway_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("gateway")
    g.add_argument("--model", default="",
                   help="a .gguf file or a HF directory with tokenizer.json; "
                        "empty = SmolLM2-135M-Instruct (default: %(default)r)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC server binds; loopback unless told (default: %(default)s)")
    g.add_argument("--port", type=PORT, default=50051, help="gRPC port (default: %(default)s)")
    g.add_argument("--http-port", type=PORT, default=8000,
                   help="OpenAI-compatible HTTP port on the same host, 0 = off; must differ from "
                        "--port (default: %(default)s)")
    g.add_argument("--max-batch-prompts", type=COUNT, default=256,
                   help="prompts in one /v1/completions batch; more get 400, before any is "
                        "tokenized (default: %(default)s)")
    g.add_argument("--shared-prefix-cache", action="store_true",
                   help="let tenants (--api-key) share prefix-cache blocks; off by default, so "
                        "that one tenant's cache hits never reveal another's prompts")
    g.add_argument("--max-streams-per-connection", type=COUNT, default=1024,
                   help="gRPC streams one connection may have open at once (HTTP/2's "
                        "MAX_CONCURRENT_STREAMS): below --max-concurrent-rpcs, one client cannot "
                        "hold every slot, but a client that opens more streams on one "
                        "connection than this gets some refused (UNAVAILABLE, REFUSED_STREAM) "
                        "(default: %(default)s)")
    g.add_argument("--max-grpc-connections", type=COUNT, default=1024,
                   help="open gRPC connections at once; past it, a new one from an address "
                        "holding fewer than the biggest holder closes that holder's least "
                        "recently active one, else it is closed at once (the client sees "
                        "UNAVAILABLE) (default: %(default)s)")
    g.add_argument("--max-grpc-connections-per-peer", type=COUNT, default=64,
                   help="open gRPC connections from one address; past it, a new one is closed at "
                        "once. A client needs one per channel; 16 addresses must join to fill "
                        "the default total. Behind a proxy or NAT every client shares one "
                        "address: raise it to --max-grpc-connections there (default: %(default)s)")
    g.add_argument("--max-connection-age", type=POSITIVE_SECONDS, default=1800.0,
                   help="seconds a gRPC connection may live: then it gets GOAWAY (clients "
                        "reconnect for new calls) and its open streams get "
                        "--max-connection-age-grace more; this is what frees the slots of a "
                        "client that reads nothing (default: %(default)s)")
    g.add_argument("--max-connection-age-grace", type=POSITIVE_SECONDS, default=600.0,
                   help="seconds a gRPC connection's open streams may run past "
                        "--max-connection-age before it is closed (default: %(default)s)")
    g.add_argument("--max-rpcs-per-peer", type=COUNT, default=256,
                   help="Generation calls one client address (its IP, whatever its port or "
                        "connection) may have in flight at once, from their headers on; past it, "
                        "RESOURCE_EXHAUSTED. Behind a proxy or NAT every client shares one "
                        "address: raise it to --max-concurrent-rpcs there (default: %(default)s)")
    g.add_argument("--grpc-first-message-timeout", type=POSITIVE_SECONDS, default=5.0,
                   help="seconds a gRPC call may take from its headers to its request message; "
                        "past it, DEADLINE_EXCEEDED, and its slot is free again "
                        "(default: %(default)s)")
    g.add_argument("--grpc-max-connection-idle", type=POSITIVE_SECONDS, default=300.0,
                   help="seconds a gRPC connection may stay without calls in flight; then it "
                        "gets GOAWAY and is closed (clients reconnect when they call again) "
                        "(default: %(default)s)")
    g.add_argument("--grpc-handshake-timeout", type=POSITIVE_SECONDS, default=10.0,
                   help="seconds a new gRPC connection gets to send its first bytes, and then to "
                        "finish its TLS handshake and send HTTP/2's preface and settings; then "
                        "it is closed (default: %(default)s)")
    g.add_argument("--max-grammar-compile-seconds", type=POSITIVE_SECONDS, default=5.0,
                   help="seconds a structured-output spec (schema, regex, grammar) may take to "
                        "compile in the gateway's check; a slower one gets INVALID_ARGUMENT / 400, and "
                        "the same spec again at once (default: %(default)s)")
    g.add_argument("--structured-check-processes", type=COUNT, default=2,
                   help="compiler children of that check (about 300 MB each): a spec that "
                        "compiles slowly holds one, and the others compile other requests' specs "
                        "meanwhile; shared fairly by tenant (by peer without --api-key): a client "
                        "alone may use all, and a client whose spec timed out holds one at a time "
                        "for 60 s (default: %(default)s)")
    g.add_argument("--max-grammar-queue-seconds", type=POSITIVE_SECONDS, default=10.0,
                   help="seconds a structured-output spec may wait for a free compiler child of "
                        "that check; past it the request gets RESOURCE_EXHAUSTED / 429. Keep it "
                        "above --max-grammar-compile-seconds, the longest another client's slow "
                        "spec holds a child (default: %(default)s)")
    g.add_argument("--structured-outputs-any-whitespace", action="store_true",
                   help="let JSON answers put whitespace anywhere (HTTP requests; gRPC sets "
                        "structured_output.any_whitespace itself); off by default, since small "
                        "models loop on free whitespace")
    g.add_argument("--structured-outputs-lazy", action="store_true",
                   help="start the structured-output check's compiler (a child process of about "
                        "300 MB that takes seconds to load the vocabulary) on the first structured "
                        "request, which then waits for it; by default it starts once the first "
                        "worker is up, and the gateway is ready (health SERVING) once it has")
    g.add_argument("--chat-template", default=None, metavar="FILE", type=_chat_template,
                   help="a Jinja chat template that replaces the model's: a file, or the template "
                        "itself inline (vLLM's flag); requests with tools use the shipped "
                        "gateway/chat/templates/chatml_tools.jinja when this one (or the model's) "
                        "never reads `tools` (default: the model's)")
    g.add_argument("--tool-call-parser", default="hermes", choices=sorted(PARSERS),
                   help="reads tool calls out of the answers of chat requests with tools and "
                        "tool_choice auto (the default), required or a named function "
                        "(default: %(default)s)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="with tool_choice none, leave the tools out of the prompt; by default "
                        "they are rendered (as vLLM does) and the answer is read as plain content")
    g.add_argument("--max-http-connections", type=COUNT, default=1024,
                   help="open HTTP connections that have presented a valid API key (without "
                        "--api-key: that have sent a request), and so requests in flight; past "
                        "it, 503 (default: %(default)s)")
    g.add_argument("--max-http-unauthenticated-connections", type=COUNT, default=256,
                   help="open HTTP connections that have not (yet) presented a valid API key; a "
                        "new one past it closes the oldest idle one, so that idle sockets cannot "
                        "keep keyed clients out (default: %(default)s)")
    g.add_argument("--max-http-connections-per-key", type=COUNT, default=512,
                   help="open HTTP connections of one API key (tenant); past it, 429 "
                        "(default: %(default)s)")
    g.add_argument("--max-http-connections-per-peer", type=COUNT, default=256,
                   help="open HTTP connections from one address (behind --trusted-proxies, "
                        "the client X-Forwarded-For names); past it, a new one is closed at "
                        "once (429 where the address comes from X-Forwarded-For) "
                        "(default: %(default)s)")
    g.add_argument("--trusted-proxies", type=_cidrs, action="extend", default=None,
                   metavar="CIDR[,CIDR...]",
                   help="proxies whose X-Forwarded-For header names the client that "
                        "--max-http-connections-per-peer counts; repeatable (default: none)")
    g.add_argument("--max-http-header-bytes", type=COUNT, default=64 << 10,
                   help="bytes of one HTTP request's head, request line included; past it, 431 "
                        "and the connection is closed (default: %(default)s)")
    g.add_argument("--max-http-headers", type=COUNT, default=100,
                   help="headers of one HTTP request; past it, 431 and the connection is closed "
                        "(default: %(default)s)")
    g.add_argument("--http-header-timeout", type=POSITIVE_SECONDS, default=10.0,
                   help="seconds a connection gets to send a whole request's headers, from "
                        "connect or its last response; then it is closed (default: %(default)s)")
    g.add_argument("--http-body-timeout", type=POSITIVE_SECONDS, default=30.0,
                   help="seconds to read a whole request body; then 408 (default: %(default)s)")
    g.add_argument("--http-write-timeout", type=POSITIVE_SECONDS, default=30.0,
                   help="seconds a response may wait on a client that reads nothing; then the "
                        "connection is closed and its requests aborted (default: %(default)s)")
    g.add_argument("--max-http-body-bytes", type=COUNT, default=1 << 20,
                   help="largest HTTP request body; a larger one gets 413 (default: %(default)s)")
    g.add_argument("--scheduler-gateway-address", default="tcp://127.0.0.1:5555",
                   help="ZeroMQ address of the scheduler's gateway socket (default: %(default)s)")
    g.add_argument("--gateway-metrics-host", default="127.0.0.1",
                   help="address /metrics binds; a container needs 0.0.0.0 (default: %(default)s)")
    g.add_argument("--gateway-metrics-port", type=PORT, default=9401,
                   help="Prometheus /metrics port, 0 = off (default: %(default)s)")
    g.add_argument("--max-message-bytes", type=COUNT, default=None,
                   help="largest gRPC response sent and ZeroMQ message received (default: the "
                        "largest valid response, computed in gateway/bounds/grpc_bounds.py, and the largest "
                        "valid message from the scheduler, computed in proto/sizes.py)")
    g.add_argument("--max-request-bytes", type=COUNT, default=None,
                   help="largest gRPC request received (default: the largest valid "
                        "GenerateRequest, computed from the request limits in gateway/bounds/grpc_bounds.py)")
    g.add_argument("--scheduler-timeout", type=POSITIVE_SECONDS, default=3.0,
                   help="seconds without any message from the scheduler (it answers a hello "
                        "sent every second) before requests in flight end UNAVAILABLE and "
                        "health turns NOT_SERVING (default: %(default)s)")
    g.add_argument("--max-unread-deltas", type=COUNT, default=256,
                   help="tokens one stream may hold unread by its client (a message without "
                        "tokens counts 1); past it the request is aborted with RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    g.add_argument("--max-concurrent-rpcs", type=COUNT, default=1024,
                   help="Generation calls one gateway serves at once, from their headers on; "
                        "past it, RESOURCE_EXHAUSTED (health and reflection are not counted) "
                        "(default: %(default)s)")
    g.add_argument("--shutdown-grace-period", type=SECONDS, default=30.0,
                   help="on SIGTERM, seconds that streams in flight get to finish (new calls get "
                        "UNAVAILABLE, health NOT_SERVING) before they are cancelled "
                        "(default: %(default)s)")
    g.add_argument("--zmq-hwm", type=COUNT, default=1000,  # shared with the scheduler and workers
                   help="ZeroMQ high-water mark: messages queued per socket and peer "
                        "(default: %(default)s)")
    g.add_argument("--log-level", default="INFO")
    for dest, default, minimum, meaning in REQUEST_LIMITS:
        g.add_argument("--" + dest.replace("_", "-"), type=int_at_least(minimum), default=default,
                       help=f"{meaning} (default: %(default)s)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require `authorization: Bearer <key>` on every Generation RPC; repeat "
                        "for several keys, each its own tenant (also env PAGODA_API_KEY)")
    g.add_argument("--tenant-priority", action="append", default=None, metavar="KEY=LO:HI",
                   help="the priorities the tenant of --api-key KEY may ask for (lower runs "
                        "first); repeat per key")
    g.add_argument("--default-tenant-priority", default=None, metavar="LO:HI",
                   help="the priorities any other tenant may ask for; 0:0 keeps tenants from "
                        "jumping each other's queue (default: +-max_priority)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM) for the gRPC port")
    g.add_argument("--ssl-keyfile", default=None, help="its private key (PEM)")
    add_auth_args(parser)
    return parser


def parse_gateway_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.main",
                                     description="pagoda gateway: gRPC in, ZeroMQ to the scheduler")
    args = add_gateway_args(parser).parse_args(argv)
    if args.http_port and args.http_port == args.port:
        parser.error(f"--http-port and --port are both {args.port}: one port cannot serve both")
    try:
        priority_ranges(args.tenant_priority, api_keys_from(args))
        if args.default_tenant_priority is not None:
            parse_range(args.default_tenant_priority)
    except ValueError as e:
        parser.error(str(e))
    for dest, ceiling in REQUEST_CEILINGS.items():
        if getattr(args, dest) > ceiling:
            parser.error(f"--{dest.replace('_', '-')} is at most {ceiling} (what the scheduler takes)")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    return args
