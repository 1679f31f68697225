"""Real clients against the gateway: the grpcurl binary, a Prometheus scrape, and the
`python -m gateway.main` process itself (flags, readiness, SIGTERM)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from gateway.metrics import start_metrics_server
from gateway.tokenizer import load_tokenizer
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.fake_scheduler import DEFAULT_REPLY as REPLY, FakeScheduler, local_gateway

ROOT = Path(__file__).resolve().parents[3]
TOK = load_tokenizer("")
SERVING = health_pb2.HealthCheckResponse.SERVING
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
harness = functools.partial(local_gateway, TOK)


def test_metrics_endpoint(run):
    async def body():
        async with harness() as h:
            tpot = "pagoda_gateway_time_per_output_token_seconds_count"
            before = REGISTRY.get_sample_value(tpot) or 0
            await h.stream(prompt="hi")
            assert REGISTRY.get_sample_value(tpot) == before + 1  # one finished index
            server = start_metrics_server(port=_free_port())
            try:
                port = server.server_port
                body = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
            finally:
                server.shutdown()
            text = body.decode()
            for name in ("pagoda_gateway_requests_total", "pagoda_gateway_time_to_first_token_seconds",
                         "pagoda_gateway_e2e_request_latency_seconds", "pagoda_gateway_tokens_streamed_total",
                         "pagoda_gateway_time_per_output_token_seconds_bucket"):
                assert name in text
            assert 'pagoda_gateway_requests_total{code="OK",method="GenerateStream"}' in text
    run(body())


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed")
def test_grpcurl(run):
    async def body():
        async with harness() as h:
            port = h.gateway.port
            services = await _grpcurl(port, "list")
            assert {"pagoda.v1.Generation", "grpc.health.v1.Health"} <= set(services.split())
            described = await _grpcurl(port, "describe", "pagoda.v1.Generation")
            assert "rpc GenerateStream ( .pagoda.v1.GenerateRequest ) returns ( stream .pagoda.v1.GenerateResponse )" in described
            out = await _grpcurl(port, "-d", json.dumps({"prompt": "Say hello"}), "pagoda.v1.Generation/GenerateStream")
            messages = _json_stream(out)
            assert "".join(m.get("text", "") for m in messages) == REPLY
            last = messages[-1]  # this grpcurl prints proto field names; newer ones may camelCase
            assert last.get("finish_reason", last.get("finishReason")) == "FINISH_REASON_LENGTH"
            health = _json_stream(await _grpcurl(port, "grpc.health.v1.Health/Check"))
            assert health == [{"status": "SERVING"}]
    run(body())


async def _grpcurl(port: int, *args: str) -> str:
    # grpcurl's syntax: flags, then the address, then the verb and its arguments.
    flags, rest = [], list(args)
    while rest and rest[0].startswith("-"):
        flags += rest[:2]
        rest = rest[2:]
    proc = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", *flags, f"127.0.0.1:{port}", *rest,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


def _json_stream(text: str) -> list[dict]:
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_main_process_serves_and_stops_on_sigterm(run):
    async def body():
        scheduler = FakeScheduler(TOK)
        port = _free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.main", "--port", str(port), "--gateway-metrics-port", "0",
            "--scheduler-gateway-address", scheduler.address, "--insecure", cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for _ in range(200):
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        if (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == SERVING:
                            break
                    await asyncio.sleep(0.05)
                stub = pagoda_pb2_grpc.GenerationStub(channel)
                reply = await stub.Generate(pb.GenerateRequest(prompt="hi"), timeout=10)
                assert reply.text == REPLY
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 15)
            assert proc.returncode == 0, out.decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await scheduler.close()
    run(body())
