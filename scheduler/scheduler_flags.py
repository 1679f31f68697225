"""The scheduler's flags. Names follow vLLM's; the launcher routes each flag to the processes
whose parser knows it (an address flag goes to both ends of its socket)."""
from __future__ import annotations

import argparse

from process_life.flag_types import COUNT, MICROSECONDS, PORT, POSITIVE_SECONDS, SECONDS, int_at_least
from proto.auth import add_auth_args


def add_scheduler_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=COUNT, default=256,
                   help="most sequences in one step's batch, per worker")
    g.add_argument("--max-num-batched-tokens", type=COUNT, default=2048,
                   help="token budget of one step, per worker; long prompts are chunked to fit")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="plan step N+1 while the worker runs step N (stops lag one step); "
                        "--no-async-scheduling waits for each result")
    g.add_argument("--max-waiting-requests", type=int_at_least(0), default=1024,
                   help="past this many waiting sequences, new requests get RESOURCE_EXHAUSTED")
    g.add_argument("--scheduler-gateway-address", default="tcp://127.0.0.1:5555")
    g.add_argument("--scheduler-worker-address", default="tcp://127.0.0.1:5556")
    g.add_argument("--scheduler-metrics-port", type=PORT, default=9400,
                   help="Prometheus /metrics on 127.0.0.1 (0 = off)")
    g.add_argument("--scheduler-metrics-host", default="127.0.0.1")
    g.add_argument("--worker-timeout", type=POSITIVE_SECONDS, default=1.5,
                   help="seconds without a heartbeat (sent every 0.25 s by a thread of the "
                        "worker's own) before a worker is dropped and its sequences recomputed "
                        "elsewhere")
    g.add_argument("--step-timeout", type=SECONDS, default=30.0,
                   help="seconds a worker's step may run beyond 4x what its size costs at the "
                        "worker's measured prefill and swap rates; past that the worker is "
                        "declared hung, dropped, and its sequences recomputed elsewhere (0 = off)")
    g.add_argument("--max-seqs-per-tenant", type=int_at_least(0), default=0,
                   help="sequences one tenant (an API key of the gateway's) may have waiting "
                        "or running at once (n each, a beam search its width); past it, "
                        "RESOURCE_EXHAUSTED (0 = no bound: tenants wait in fair order, and a "
                        "full --max-waiting-requests gives a tenant holding fewer the place of "
                        "the newest waiting request of the one holding most)")
    g.add_argument("--max-step-failures", type=int_at_least(0), default=2,
                   help="a sequence whose step was lost with its worker (it died or timed out "
                        "during it) on this many workers in a row ends with INTERNAL instead of "
                        "being recomputed on the next; one that shared the step with other "
                        "requests first runs alone, and ends if that fails too (0 = never)")
    g.add_argument("--gateway-timeout", type=POSITIVE_SECONDS, default=5.0,
                   help="seconds without a message from a gateway (it says hello every second) "
                        "before its requests are aborted and their blocks freed")
    g.add_argument("--no-worker-timeout", type=POSITIVE_SECONDS, default=10.0,
                   help="seconds with no worker registered after which requests waiting for "
                        "one end UNAVAILABLE")
    g.add_argument("--zmq-hwm", type=COUNT, default=1000,
                   help="ZeroMQ high-water mark: messages queued per socket and peer")
    g.add_argument("--max-model-len", type=COUNT, default=None,
                   help="the longest context a worker may register with (the worker's flag too; "
                        "default 8192, the most a worker takes by default); with the other "
                        "limits it sizes the largest message accepted from a gateway; a worker "
                        "with a longer one is refused")
    g.add_argument("--max-message-bytes", type=COUNT, default=None,
                   help="largest ZeroMQ message accepted on either socket (default: the largest "
                        "valid message of each, computed in proto/sizes.py)")
    g.add_argument("--busy-poll-us", type=MICROSECONDS, default=None,
                   help="after sending, poll without sleeping this long for the reply (lower step "
                        "latency for a little CPU; 0 = always sleep; default: 500 with 4 or more "
                        "cores, else 0)")
    g.add_argument("--log-level", default="INFO")
    add_auth_args(parser)
    return parser
