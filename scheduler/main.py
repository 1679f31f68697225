"""`python -m scheduler.main [flags]`: the CPU-only scheduler process."""
from __future__ import annotations

import argparse
import logging

from prometheus_client import REGISTRY, start_http_server

from proto.auth import check_auth_args
from scheduler.args import add_scheduler_args
from scheduler.metrics import RouterCollector
from scheduler.server import SchedulerServer


def main(argv: list[str] | None = None) -> None:
    args = add_scheduler_args(argparse.ArgumentParser("pagoda-scheduler")).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s")
    check_auth_args(args, args.scheduler_gateway_address, args.scheduler_worker_address)
    server = SchedulerServer(args)
    if args.scheduler_metrics_port:
        REGISTRY.register(RouterCollector(server.router))
        start_http_server(args.scheduler_metrics_port, addr=args.scheduler_metrics_host)
    server.serve()


if __name__ == "__main__":
    main()
