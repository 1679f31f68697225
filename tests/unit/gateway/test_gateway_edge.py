"""The gateway's edge against a fake scheduler, in process: HTTPS with --ssl-certfile, a client
that stops reading an SSE stream, and a link whose numbering the scheduler restarted."""
from __future__ import annotations

import asyncio
import socket
import ssl
import time

import httpx2 as httpx  # what the openai client itself runs on
import pytest
from grpc_health.v1 import health_pb2

from gateway.app import Gateway
from gateway.bounds.edge import EdgeConfig
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.tokenizer import load_tokenizer
from proto import internal_pb2 as ipb
from tests.cluster import free_port
from tests.fake_scheduler import FakeScheduler, local_gateway, out, until, workers_of
from tests.faults.test_security import _self_signed

TOK = load_tokenizer("")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_http_port_speaks_tls_when_the_grpc_port_does(run, tmp_path):
    cert, key = _self_signed(tmp_path)

    async def main():
        scheduler = FakeScheduler(TOK)
        gateway = Gateway(TOK, scheduler.address, port=0, http_port=free_port(), ssl=(cert, key))
        await gateway.start()
        try:
            await until(lambda: workers_of(gateway.client) >= 1)
            url = f"https://127.0.0.1:{gateway.http_port}/health"
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=cert)) as tls:
                assert (await tls.get(url)).status_code == 200
            async with httpx.AsyncClient() as plain:  # plaintext to a TLS port gets nowhere
                with pytest.raises(httpx.HTTPError):
                    await plain.get(url.replace("https", "http"), timeout=5)
        finally:
            await gateway.stop(0.5)
            await scheduler.close()
    run(main())


def test_an_sse_client_that_reads_nothing_is_hung_up_on_and_its_request_aborted(run):
    """--http-write-timeout: once the response has filled every buffer on the way and waited
    that long, the connection is closed, which aborts the request at the scheduler."""
    long_token = max(range(TOK.vocab_size), key=lambda t: len(TOK.token_bytes(t)))

    def endless(add: ipb.AddRequest) -> list:
        # Many bytes a delta: the buffers fill within the test's time even on a loaded machine,
        # whose gateway turns fewer deltas a second into SSE events.
        return [out(request_id=add.request_id, token_ids=[long_token] * 64)
                for _ in range(2_300)]

    async def main():
        scheduler = FakeScheduler(TOK, max_model_len=200_000)  # room for 160,000 tokens
        scheduler.plan = endless
        # Unread deltas unbounded here, so that only the write timeout can end the request.
        client = SchedulerClient(scheduler.address, max_unread=10**9)
        gateway = Gateway(TOK, scheduler.address, port=0, http_port=free_port(), client=client,
                          edge=EdgeConfig(http_write_timeout=0.5))
        await gateway.start()
        try:
            await until(lambda: workers_of(gateway.client) >= 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", gateway.http_port))
            body = (b'{"model": "%s", "prompt": "hi", "max_tokens": 150000, "stream": true}'
                    % TOK.name.encode())
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            started = time.monotonic()
            await until(lambda: scheduler.aborts, timeout=20)
            took = time.monotonic() - started
            # Now read: what the buffers held, then the end of a connection the gateway closed.
            sock.settimeout(5)
            received = 0
            while chunk := await asyncio.to_thread(sock.recv, 1 << 16):
                received += len(chunk)
            sock.close()
            print(f"\nhung up on after {took:.1f} s; {received} bytes were in the buffers")
            assert len(set(scheduler.aborts)) == 1 and received > 0
            assert not gateway.client._queues  # nothing of the request is left in the gateway
        finally:
            await gateway.stop(0.5)
            await scheduler.close()
    run(main())


def test_a_link_whose_numbering_restarted_is_declared_lost_then_resynchronized(run):
    """The scheduler restarts a link's seq under the same epoch: every message looks repeated.
    That is not hearing the scheduler: health goes NOT_SERVING after --scheduler-timeout, and the
    link then takes the scheduler's numbering as its new start, by itself."""
    async def main():
        client = SchedulerClient("", keepalive_interval=0.1, lost_after=0.5)
        seen: list = []

        async def record(info) -> None:
            seen.append(info is not None)
        client.add_info_listener(record)
        async with local_gateway(TOK, client=client) as h:
            peer = next(iter(h.scheduler.peers))
            for _ in range(300):  # the link's numbering goes far ahead ...
                await h.scheduler.send(peer, ipb.SchedulerMessage(info=h.scheduler.info()))
            await until(lambda: client._seq >= 300)
            seen.clear()
            h.scheduler.seqs[peer] = 0  # ... and the scheduler starts it again at 1
            # Lost (health NOT_SERVING: the gateway's own listener sets it), then heard again.
            await until(lambda: False in seen and seen[-1], timeout=5)
            assert seen[seen.index(False) + 1:] and all(seen[seen.index(False) + 1:])
            assert await h.health_of() == SERVING
            text = "".join(r.text for r in await h.stream(prompt="hi"))
            assert text == "Héllo 😀 wörld, 日本語 and 🇯🇵 done."
    run(main())
