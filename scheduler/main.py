"""`python -m scheduler.main [flags]`: the CPU-only scheduler process."""
from __future__ import annotations

import argparse
import logging

from prometheus_client import REGISTRY

from process_life import lifetime, watchdog
from process_life.loop_metrics import start_metrics_server
from proto.auth import check_auth_args
from scheduler.scheduler_flags import add_scheduler_args
from scheduler.metrics import RouterCollector
from scheduler.server import SchedulerServer


def main(argv: list[str] | None = None) -> None:
    parser = add_scheduler_args(argparse.ArgumentParser("pagoda-scheduler"))
    args = watchdog.add_flag(parser, watchdog.LOOP_TIMEOUT_S).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s")
    check_auth_args(args, args.scheduler_gateway_address, args.scheduler_worker_address,
                    role="scheduler")
    lifetime.start(drain_s=0.0)  # its loop ends at the next turn; only sockets are left to close
    watchdog.start(args.watchdog_timeout, watchdog.LOOP_TIMEOUT_S)
    server = SchedulerServer(args)
    if args.scheduler_metrics_port:
        REGISTRY.register(RouterCollector(server.router))
        # 503 once the loop stalls: this page is the scheduler's health check.
        start_metrics_server(args.scheduler_metrics_port, args.scheduler_metrics_host)
    server.serve()


if __name__ == "__main__":
    main()
    lifetime.exit_now(0)
