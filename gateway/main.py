"""`python -m gateway.main [flags]`: one gateway process.

SIGINT/SIGTERM start a graceful stop: health turns NOT_SERVING, new RPCs are refused, RPCs in
flight get --shutdown-grace-period seconds to finish, and the rest are cancelled (which aborts
them at the scheduler).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import uvloop

from gateway.app import Gateway
from gateway.args import parse_gateway_args
from gateway.metrics import start_metrics_server
from gateway.tokenizer import load_tokenizer
from gateway.validate import limits_from_args

log = logging.getLogger("pagoda.gateway")


async def run(args) -> None:
    tokenizer = load_tokenizer(args.model)
    gateway = Gateway(tokenizer, args.scheduler_gateway_address, host=args.host, port=args.port,
                      max_message_bytes=args.max_message_bytes,
                      limits=limits_from_args(args, max_model_len=0, vocab_size=0))
    await gateway.start()
    metrics_server = start_metrics_server(args.gateway_metrics_port, args.gateway_metrics_host)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: streams in flight get %g s to finish", args.shutdown_grace_period)
    finally:
        started = time.monotonic()
        await gateway.stop(args.shutdown_grace_period)
        log.info("stopped after %.1f s of draining", time.monotonic() - started)
        if metrics_server is not None:
            metrics_server.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_gateway_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s gateway: %(message)s")
    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
