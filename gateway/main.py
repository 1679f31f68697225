"""`python -m gateway.main [flags]`: one gateway process.

SIGINT/SIGTERM start a graceful stop: health turns NOT_SERVING, new RPCs are refused, RPCs in
flight get --shutdown-grace-period seconds to finish, and the rest are cancelled (which aborts
them at the scheduler).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

import uvloop

from gateway.app import Gateway
from gateway.bounds.client_auth import api_keys_from
from gateway.bounds.edge import EdgeConfig
from gateway.gateway_flags import parse_gateway_args
from gateway.bounds.grpc_bounds import (CONTEXT_BOUND, largest_generate_request, largest_response,
                                        token_sizes)
from gateway.metrics import start_metrics_server
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.tokenizer import load_tokenizer
from gateway.validation.limits import limits_from_args
from process_life import lifetime, watchdog
from process_life.flag_errors import FlagError, main_refusing
from proto.auth import check_auth_args
from proto.sizes import largest_scheduler_message

log = logging.getLogger("pagoda.gateway")


async def run(args) -> None:
    try:
        tokenizer = load_tokenizer(args.model, args.chat_template)
    except (FileNotFoundError, ValueError) as e:  # the messages name --model
        raise FlagError(str(e)) from None
    limits = limits_from_args(args, max_model_len=0, vocab_size=0)
    # A client may send no more than the largest valid request needs.
    max_request_bytes = args.max_request_bytes or largest_generate_request(limits)
    # No valid response is refused, nothing much larger goes out.
    max_response_bytes = args.max_message_bytes or largest_response(limits, token_sizes(tokenizer))
    # The largest valid message from the scheduler (proto/sizes.py), and nothing much larger.
    zmq_bytes = args.max_message_bytes or largest_scheduler_message(limits.max_logprobs, CONTEXT_BOUND)
    client = SchedulerClient(args.scheduler_gateway_address, zmq_bytes,
                             keepalive_interval=min(1.0, args.scheduler_timeout / 3),
                             lost_after=args.scheduler_timeout,
                             max_unread=args.max_unread_deltas, hwm=args.zmq_hwm,
                             keys_dir=args.zmq_keys_dir, model=tokenizer.name)
    gateway = Gateway(tokenizer, args.scheduler_gateway_address, host=args.host, port=args.port,
                      max_response_bytes=max_response_bytes,
                      client=client, limits=limits,
                      max_concurrent_rpcs=args.max_concurrent_rpcs,
                      max_request_bytes=max_request_bytes,
                      http_port=args.http_port, max_http_body_bytes=args.max_http_body_bytes,
                      keys_dir=args.zmq_keys_dir, api_keys=api_keys_from(args),
                      ssl=(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None,
                      edge=EdgeConfig.from_args(args), warm_grammar=not args.structured_outputs_lazy)
    log.info("largest gRPC request accepted: %d bytes, response sent: %d bytes; largest "
             "scheduler message: %d bytes", max_request_bytes, max_response_bytes, zmq_bytes)
    await gateway.start()
    metrics_server = start_metrics_server(args.gateway_metrics_port, args.gateway_metrics_host)
    # After the start: loading the tokenizer blocks the loop, and must not count as a hang.
    ticks = asyncio.create_task(watchdog.tick_forever())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        lifetime.stopping(sig.name)  # the loop owns the wakeup fd: the bound learns of it here
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
    finally:
        grace = lifetime.drain(args.shutdown_grace_period)  # cut short once the launcher is gone
        log.info("shutting down: streams in flight get %g s to finish", grace)
        started = time.monotonic()
        await gateway.stop(grace)
        log.info("stopped after %.1f s of draining", time.monotonic() - started)
        if metrics_server is not None:
            metrics_server.shutdown()
        ticks.cancel()


def main(argv: list[str] | None = None) -> int:
    # --watchdog-timeout is read here, the rest by gateway/gateway_flags.py.
    own = watchdog.add_flag(argparse.ArgumentParser(add_help=False, allow_abbrev=False),
                            watchdog.LOOP_TIMEOUT_S)
    known, rest = own.parse_known_args(argv)
    args = parse_gateway_args(rest)
    check_auth_args(args, args.scheduler_gateway_address)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s gateway: %(message)s")
    lifetime.start(args.shutdown_grace_period, watch_signals=False)
    watchdog.start(known.watchdog_timeout, watchdog.LOOP_TIMEOUT_S)
    uvloop.run(run(args))
    return 0


if __name__ == "__main__":
    lifetime.exit_now(main_refusing(main))
