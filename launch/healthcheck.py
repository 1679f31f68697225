"""`python -m launch.healthcheck TARGET`: exit 0 when a pagoda process is healthy, else 1. For
compose's HEALTHCHECK, with nothing but the image's Python.

    grpc://HOST:PORT   the gateway's grpc.health.v1 answers SERVING (it has workers and is not
                       draining)
    http://HOST:PORT/metrics   the scheduler's metrics endpoint answers 200: it answers 503 once
                               the scheduler's loop has not turned for 5 s (process_life/loop_metrics.py)
"""
from __future__ import annotations

import sys
import urllib.request

TIMEOUT_S = 3.0


def healthy(target: str) -> tuple[bool, str]:
    if target.startswith("grpc://"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(target[len("grpc://"):]) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S).status
            except grpc.RpcError as e:
                return False, f"{target}: {e.code().name}"
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        return status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {name}"
    if target.startswith("http://"):
        try:
            with urllib.request.urlopen(target, timeout=TIMEOUT_S) as r:
                return r.status == 200, f"{target}: HTTP {r.status}"
        except OSError as e:
            return False, f"{target}: {e}"
    return False, f"{target}: give grpc://HOST:PORT or http://HOST:PORT/PATH"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    ok, why = healthy(argv[0])
    print(why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
