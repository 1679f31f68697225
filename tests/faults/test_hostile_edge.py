"""Hostile clients against the public edge of the real stack (scheduler, gateway, fake worker
processes; the model is not the point here). Each attack is its own test. While it runs, another
tenant's stream must finish token-exact; afterwards a small request is answered within 2 s, the
gateway's RSS has grown by at most 200 MB (it runs under an address-space limit, so a regression
fails here instead of exhausting the machine) and every block is free again."""
from __future__ import annotations

import http.client
import json
import select
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc
from tests.cluster import wait_for
from tests.fake_cluster import SERVING, FakeCluster, rss_bytes
from tests.fake_worker import reference_output
from tests.streams import Stream

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"
AUTH_A, AUTH_B = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
MAX_WAITING, MAX_RUNNING = 16, 8   # the scheduler holds 24 sequences (ClusterInfo.max_sequences)
TENANT_QUOTA = 12  # half of it
MAX_BATCH_PROMPTS = 64
MAX_RPCS = 24
RSS_GROWTH = 200e6
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    c = FakeCluster(
        tmp_path_factory.mktemp("hostile"), http=True, gateway_address_space=3 << 30,
        scheduler_flags=["--max-waiting-requests", str(MAX_WAITING),
                         "--max-num-seqs", str(MAX_RUNNING),
                         "--max-seqs-per-tenant", str(TENANT_QUOTA)],
        gateway_flags=["--api-key", KEY_A, "--api-key", KEY_B,
                       "--default-tenant-priority", "0:0", "--tenant-priority", f"{KEY_B}=-10:10",
                       "--max-batch-prompts", str(MAX_BATCH_PROMPTS),
                       "--max-concurrent-rpcs", str(MAX_RPCS), "--max-unread-deltas", "16",
                       "--http-header-timeout", "1", "--http-body-timeout", "1",
                       "--max-http-connections", "16", "--max-http-unauthenticated-connections", "8"],
        worker_flags=["--num-gpu-blocks-override", "20000", "--step-delay", "0.01"]).start()
    c.rss_at_start = rss_bytes(c.gateway.pid)
    limits = Path(f"/proc/{c.gateway.pid}/limits").read_text()
    assert f"Max address space         {3 << 30}" in limits, limits
    yield c
    c.stop()


def victim(stack, i: int, max_tokens: int = 60) -> Stream:
    """Tenant B's greedy stream, checked against the fake model's reference when it ends."""
    req = pb.GenerateRequest(prompt_token_ids=[7, 8, 9, 100 + i], sampling=pb.SamplingParams(seed=i),
                             stopping=pb.StoppingCriteria(max_tokens=max_tokens))
    stream = Stream(stack.stub, req, metadata=AUTH_B)
    assert wait_for(lambda: stream.tokens, 10)
    return stream


def check_undisturbed(stack, stream: Stream, i: int, max_tokens: int = 60) -> None:
    stream.join(60)
    assert stream.code == grpc.StatusCode.OK, stream.details
    assert stream.tokens == reference_output([7, 8, 9, 100 + i], max_tokens, seed=i)
    started = time.monotonic()
    r = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3],
                                               stopping=pb.StoppingCriteria(max_tokens=2)),
                            metadata=AUTH_A, timeout=10)
    assert len(r.token_ids) >= 1 and time.monotonic() - started < 2.0
    assert stack.health_status() == SERVING
    assert wait_for(stack.idle_and_free, 30), stack.scheduler_metrics()
    assert rss_bytes(stack.gateway.pid) - stack.rss_at_start < RSS_GROWTH


def post(stack, path: str, body: bytes | dict, key: str = KEY_A, timeout: float = 30):
    """(status, the body parsed as JSON or else its text, seconds) of one HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    started = time.monotonic()
    conn.request("POST", path, data, {"Content-Type": "application/json",
                                      "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = payload.decode(errors="replace")
    return response.status, parsed, time.monotonic() - started


def assert_openai_error(status: int, body: dict, expected_status: int, param: str | None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and body["error"]["param"] == param, body
    assert body["error"]["type"] == {400: "invalid_request_error",
                                     429: "rate_limit_error"}[expected_status]


# ---------------------------------------------------------------------------- bounded work

def test_n_of_a_billion_is_refused_before_anything_is_built(stack):
    stream = victim(stack, 1)
    status, body, took = post(stack, "/v1/completions",
                              {"model": MODEL, "prompt": "hi", "n": 1_000_000_000})
    assert_openai_error(status, body, 400, "n")
    assert "between 1 and 16" in body["error"]["message"] and took < 2.0
    status, body, _ = post(stack, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 10**9})
    assert_openai_error(status, body, 400, "n")
    check_undisturbed(stack, stream, 1)


def test_a_batch_of_200000_prompts_is_refused_before_tokenizing(stack):
    stream = victim(stack, 2)
    status, body, took = post(stack, "/v1/completions",
                              {"model": MODEL, "prompt": ["a"] * 200_000, "max_tokens": 1})
    assert_openai_error(status, body, 400, "prompt")
    assert f"at most {MAX_BATCH_PROMPTS}" in body["error"]["message"] and took < 2.0
    check_undisturbed(stack, stream, 2)


def test_a_burst_past_what_the_scheduler_holds_is_refused_with_429(stack):
    stream = victim(stack, 3)
    # One batch of more sequences than the scheduler can hold: refused whole, at once.
    status, body, took = post(stack, "/v1/completions", {
        "model": MODEL, "prompt": [[5, 6, i] for i in range(MAX_BATCH_PROMPTS)], "max_tokens": 40})
    assert_openai_error(status, body, 429, None)
    assert "the scheduler is full" in body["error"]["message"] and took < 2.0
    # A burst of gRPC streams: each is served token-exact or refused RESOURCE_EXHAUSTED.
    reqs = [pb.GenerateRequest(prompt_token_ids=[11, 12, i], sampling=pb.SamplingParams(seed=i),
                               stopping=pb.StoppingCriteria(max_tokens=60)) for i in range(60)]
    channels = [grpc.insecure_channel(stack.target) for _ in range(6)]  # 10 streams on each
    burst = [Stream(pagoda_pb2_grpc.GenerationStub(channels[i % 6]), r, metadata=AUTH_A)
             for i, r in enumerate(reqs)]
    for s in burst:
        s.join(60)
    for channel in channels:
        channel.close()
    served = [i for i, s in enumerate(burst) if s.code == grpc.StatusCode.OK]
    refused = [s for s in burst if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    others = [(s.code, s.details) for s in burst if s.code not in (grpc.StatusCode.OK,
                                                                   grpc.StatusCode.RESOURCE_EXHAUSTED)]
    print(f"\nburst of 60 streams: {len(served)} served, {len(refused)} refused")
    assert others == [] and refused and served
    for i in served:
        assert burst[i].tokens == reference_output([11, 12, i], 60, seed=i)
    check_undisturbed(stack, stream, 3)


# ---------------------------------------------------------------------------- isolation

def cached_tokens(stack, key: str, prompt: list[int], salt: str | None = None) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    status, reply, _ = post(stack, "/v1/completions", body, key=key)
    assert status == 200, reply
    return reply["usage"].get("prompt_tokens_details", {"cached_tokens": 0})["cached_tokens"]


def test_tenants_never_hit_each_others_cached_prefixes(stack):
    prompt = list(range(300, 381))  # 81 tokens: 20 full blocks of 4
    assert cached_tokens(stack, KEY_A, prompt) == 0
    assert cached_tokens(stack, KEY_A, prompt) == 80   # the same tenant hits its own blocks
    assert cached_tokens(stack, KEY_B, prompt) == 0    # another tenant does not
    assert cached_tokens(stack, KEY_B, prompt) == 80
    assert cached_tokens(stack, KEY_A, prompt, salt="s") == 0  # a salt of its own: apart again
    assert cached_tokens(stack, KEY_A, prompt, salt="s") == 80
    # gRPC shares the rule: tenant B over gRPC hits B's blocks and never A's salted ones.
    r = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                               stopping=pb.StoppingCriteria(max_tokens=1)),
                            metadata=AUTH_B, timeout=10)
    assert r.usage.cached_prompt_tokens == 80


def test_one_tenant_can_neither_fill_the_queue_nor_jump_it(stack):
    def stream(i: int, metadata, priority: int = 0) -> Stream:
        return Stream(stack.stub, pb.GenerateRequest(
            prompt_token_ids=[60, 61, i], sampling=pb.SamplingParams(seed=i), priority=priority,
            stopping=pb.StoppingCriteria(max_tokens=60)), metadata=metadata)
    hog = [stream(i, AUTH_A) for i in range(20)]
    assert wait_for(lambda: sum(s.code == grpc.StatusCode.RESOURCE_EXHAUSTED for s in hog) == 8, 20)
    # Tenant A holds its whole quota; tenant B is admitted beside it, ahead of it if it asks.
    others = [stream(100 + i, AUTH_B, priority=-10) for i in range(8)]
    for s in hog + others:
        s.join(60)
    assert [s.code for s in others] == [grpc.StatusCode.OK] * 8
    for i, s in enumerate(others):
        assert s.tokens == reference_output([60, 61, 100 + i], 60, seed=100 + i)
    served = [i for i, s in enumerate(hog) if s.code == grpc.StatusCode.OK]
    refused = [s for s in hog if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(served) == TENANT_QUOTA and len(refused) == 8
    assert all(s.details.startswith(f"this tenant has {TENANT_QUOTA} sequences in flight")
               for s in refused)
    # Priorities: tenant A may ask for none but 0, tenant B for [-10, 10].
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], priority=-1,
                                               stopping=pb.StoppingCriteria(max_tokens=1)),
                            metadata=AUTH_A, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "priority must be in [0, 0] for this API key, got -1"
    status, body, _ = post(stack, "/v1/completions", {"model": MODEL, "prompt": [1, 2],
                                                      "max_tokens": 1, "priority": 11}, key=KEY_B)
    assert_openai_error(status, body, 400, "priority")
    assert wait_for(stack.idle_and_free, 30)


# ---------------------------------------------------------------------------- malformed bodies

MALFORMED = {
    "deep nesting": (b"[" * 100_000, None),
    "deep nesting in a field": (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"}", None),
    "a logit_bias key that is a digit only to str.isdigit": (
        json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {"\u00b2": 1}}).encode(),
        "logit_bias"),
    "a lone surrogate in a prompt": (b'{"model": "%s", "prompt": "a\\ud800"}' % MODEL.encode(),
                                     "prompt"),
    "a lone surrogate in chat content": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL.encode(),
        "messages.0.content"),
    # numbers past the gRPC field they are copied into (protobuf raised ValueError: a 500)
    "a seed past 64 bits": (json.dumps({"model": MODEL, "prompt": "hi", "seed": 2**70}).encode(), "seed"),
    "a seed below 64 signed bits": (json.dumps({"model": MODEL, "prompt": "hi", "seed": -2**63 - 1}).encode(), "seed"),
    "a top_k past 32 bits": (json.dumps({"model": MODEL, "prompt": "hi", "top_k": 2**32}).encode(), "top_k"),
    "a prompt mixing text and token ids": (json.dumps({"model": MODEL, "prompt": ["a", [1]]}).encode(), "prompt"),
    "not UTF-8": (b'{"model": "\xff"}', None),
    "not an object": (b"[1, 2]", None),
    "truncated": (b'{"model": ', None),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_body_gets_400_and_no_traceback(stack, case):
    data, param = MALFORMED[case]
    path = "/v1/chat/completions" if b"messages" in data else "/v1/completions"
    status, body, _ = post(stack, path, data)
    assert_openai_error(status, body, 400, param)
    assert "Traceback" not in (stack.log_dir / "gateway.log").read_text(errors="replace")


# ---------------------------------------------------------------------------- slow clients

def test_a_connection_that_never_finishes_its_headers_is_closed(stack):
    idle = socket.create_connection(("127.0.0.1", stack.http_port))
    slow = socket.create_connection(("127.0.0.1", stack.http_port))
    started = time.monotonic()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    for sock in (idle, slow):
        sock.settimeout(5)
        while True:  # slowloris: a header byte now and then, never the blank line
            try:
                sock.sendall(b"X")
            except OSError:
                break
            try:
                if sock.recv(1024) == b"":
                    break
            except socket.timeout:
                pytest.fail("the gateway kept a connection without headers open for 5 s")
            except OSError:
                break
        sock.close()
    assert time.monotonic() - started < 3.0  # --http-header-timeout 1


def test_a_body_that_never_arrives_gets_408(stack):
    sock = socket.create_connection(("127.0.0.1", stack.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
    sock.settimeout(5)
    started = time.monotonic()
    head = sock.recv(4096)
    sock.close()
    assert head.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 3.0


def test_idle_sockets_cannot_take_the_connection_cap_from_a_keyed_client(stack):
    """16 sockets that never send a key: 8 wait (--max-http-unauthenticated-connections), each
    newer one closing the oldest idle one; the keyed client's closes one more, then is served.
    (Checked before --http-header-timeout closes the rest; more in test_hostile_http_edge.py.)"""
    held = [socket.create_connection(("127.0.0.1", stack.http_port)) for _ in range(16)]
    try:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=5)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
        assert conn.getresponse().status == 200
        conn.close()
        closed = lambda: select.select(held, [], [], 0)[0]  # readable: the gateway's FIN  # noqa: E731
        assert wait_for(lambda: len(closed()) >= 9, 0.5)
        assert [sock in closed() for sock in held] == [True] * 9 + [False] * 7
    finally:
        for sock in held:
            sock.close()


# ---------------------------------------------------------------------------- drain (last: it stops the gateway)

def test_sigterm_lets_an_http_stream_finish_as_grpc_streams_do(stack):
    """uvicorn's own default cut streams after 5 s; the gateway's grace (30 s) holds for both."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": [21, 22, 23], "max_tokens": 600, "ignore_eos": True,
        "stream": True, "seed": 5}), {"Content-Type": "application/json",
                                      "Authorization": f"Bearer {KEY_A}"})
    response = conn.getresponse()
    assert response.status == 200
    grpc_stream = Stream(stack.stub, pb.GenerateRequest(
        prompt_token_ids=[24, 25], sampling=pb.SamplingParams(seed=6),
        stopping=pb.StoppingCriteria(max_tokens=600, ignore_eos=True)), metadata=AUTH_B)
    events = [response.readline()]
    assert wait_for(lambda: grpc_stream.tokens, 10)  # both streams are in flight
    stack.gateway.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for line in response:
        events.append(line)
    took = time.monotonic() - signalled
    data = [e[len(b"data: "):].strip() for e in events if e.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    grpc_stream.join(60)
    assert grpc_stream.code == grpc.StatusCode.OK
    assert grpc_stream.tokens == reference_output([24, 25], 600, seed=6, ignore_eos=True)
    assert stack.gateway.wait(30) == 0
    print(f"\nafter SIGTERM the HTTP stream went on for {took:.1f} s ({len(text)} characters)")
    assert took > 5.0  # past uvicorn's old cut


# ---------------------------------------------------------------------------- connection age (last: a gateway of its own)

def test_a_client_that_reads_nothing_frees_its_rpc_slots_and_cannot_open_every_connection(stack):
    """Streams whose client reads nothing are aborted for --max-unread-deltas (their work and
    blocks freed at once), but grpc.aio cannot end their calls: each holds its
    --max-concurrent-rpcs slot. The connection's age frees them: past --max-connection-age it
    gets GOAWAY, past the grace it is closed, and another client is served again. Connections
    are bounded too (--max-grpc-connections): one past the limit is refused. (Last, with the
    module's gateway restarted with a short age: it would recycle every other test's
    connections.)"""
    age, grace, connections = 3.0, 0.5, 3
    # Half the slots of the module's gateway: the unread streams then stay well inside the
    # scheduler's room and each tenant's quota, so none is refused (which would free its slot).
    slots = MAX_RPCS // 2
    if stack.gateway.poll() is None:  # run alone: the SIGTERM test has not stopped it
        stack.gateway.send_signal(signal.SIGTERM)
        stack.gateway.wait(30)
    assert wait_for(stack.idle_and_free, 30), stack.scheduler_metrics()
    stack.gateway_flags = [*stack.gateway_flags, "--max-concurrent-rpcs", str(slots),
                           "--max-connection-age", str(age),
                           "--max-connection-age-grace", str(grace),
                           "--max-grpc-connections", str(connections)]
    stack.start_gateway()
    assert stack.wait_health(SERVING, 30), stack.log_tail()
    small = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], stopping=pb.StoppingCriteria(max_tokens=2))
    slow = grpc.insecure_channel(stack.target, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    opened = time.monotonic()
    unread = [pagoda_pb2_grpc.GenerationStub(slow).GenerateStream(pb.GenerateRequest(
        prompt_token_ids=[40, 41, i], stopping=pb.StoppingCriteria(max_tokens=4000, ignore_eos=True)),
        metadata=(AUTH_A, AUTH_B)[i % 2], timeout=120) for i in range(slots)]
    others: list[grpc.Channel] = []
    try:
        assert wait_for(lambda: not stack.idle_and_free(), 10)  # they run
        assert wait_for(stack.idle_and_free, 30), stack.scheduler_metrics()  # and are aborted
        assert time.monotonic() - opened < age - 1  # the rest of this block runs before GOAWAY
        with pytest.raises(grpc.RpcError) as held:
            stack.stub.Generate(small, metadata=AUTH_B, timeout=10)
        assert held.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # every slot is held
        # stack.channel and `slow` are two connections: the third is the last one allowed.
        others = [grpc.insecure_channel(stack.target, options=[("grpc.use_local_subchannel_pool", 1)])
                  for _ in range(2)]
        grpc.channel_ready_future(others[0]).result(timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            pagoda_pb2_grpc.GenerationStub(others[1]).Generate(small, metadata=AUTH_B, timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for channel in others:  # stack.channel, aged too, reconnects within the limit
            channel.close()
        # Past age + grace (+10% jitter) the reading-nothing connection is closed. (Its client
        # learns only when it reads: its transport stopped reading the socket when it was full.)
        def served() -> bool:
            try:
                return len(stack.stub.Generate(small, metadata=AUTH_B, timeout=2).token_ids) == 2
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                return False
        assert wait_for(served, (age + grace) * 1.1 + 5)
        freed = time.monotonic() - opened
        assert freed > age * 0.9  # by the age, not by anything sooner
        print(f"\nslots held by {slots} unread streams freed {freed:.1f} s after they opened")
    finally:
        for call in unread:
            call.cancel()
        for channel in (slow, *others):
            channel.close()
