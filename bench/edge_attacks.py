"""The hostile client of the edge soak (bench/edge_soak.py): every attack of issue 53, items 1-12,
in turn, until a deadline, against the public interfaces only (gRPC through proto/, raw sockets
for HTTP/2 and HTTP/1.1, httpx2 for HTTP). Every loop and size is bounded; every socket is
from a loopback address of its own (127.0.0.2 and up; gRPC channels through a local relay that
binds one), so per-peer bounds see the attacker apart from the legitimate clients.

    .venv/bin/python -m bench.edge_attacks --grpc 127.0.0.1:50051 --http 127.0.0.1:8000 \\
        --key KEY_A --probe-key KEY_B --seconds 600 --out /tmp/attacks.jsonl

Each attack appends one JSON line: its name, the issue's item, when it ran, `codes` (what each
request or connection it made got: a gRPC code, an HTTP status, or what the socket saw),
`probe` (a keyed bystander's small Generate and a health check from fresh channels while the
attack held), and `note` (sizes: bytes the server took, ids it aborted, workers it named).
--key is the attacker's own tenant; --probe-key is used only for the bystander's probes.
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.edge_raw import SERVICE, H2Conn, Relay, h2_frame
from proto import pagoda_pb2 as pb, pagoda_pb2_grpc

MB = 1 << 20


# ---------------------------------------------------------------------------- the attacker

class Attacker:
    def __init__(self, opts) -> None:
        self.opts, self.scale, self.hold = opts, opts.scale, opts.hold
        host, port = opts.grpc.rsplit(":", 1)
        self.grpc_port, self.http_base = int(port), f"http://{opts.http}"
        self.http_port = int(opts.http.rsplit(":", 1)[1])
        self.relay = Relay((host, self.grpc_port), "127.0.0.2")
        self.channel = grpc.insecure_channel(self.relay.address, options=[
            ("grpc.max_send_message_length", 64 * MB), ("grpc.max_receive_message_length", 64 * MB)])
        self.stub = pagoda_pb2_grpc.GenerationStub(self.channel)
        self.auth = (("authorization", f"Bearer {opts.key}"),)
        self.http = httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.3"),
                                  timeout=60, headers={"Authorization": f"Bearer {opts.key}"})
        self.model = self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.auth, timeout=30).model
        self.round = 0
        self.details: set[str] = set()  # the server's messages, for the record (set.add is atomic)

    def n(self, count: int) -> int:
        return max(1, int(count * self.scale))

    # -- helpers

    def grpc_call(self, method: str, request, timeout: float = 60, key: bool = True) -> str:
        """The call's gRPC code (OK, or the error's) as the attack's outcome."""
        try:
            call = getattr(self.stub, method)
            reply = call(request, metadata=self.auth if key else None, timeout=timeout)
            if method == "GenerateStream":
                for _ in reply:
                    pass
            return "OK"
        except grpc.RpcError as e:
            self.details.add(f"{e.code().name}: {(e.details() or '')[:160]}")
            return e.code().name

    def post(self, path: str, body: dict | bytes, timeout: float = 60) -> str:
        try:
            r = (self.http.post(self.http_base + path, content=body, timeout=timeout,
                                headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
                 else self.http.post(self.http_base + path, json=body, timeout=timeout))
        except httpx2.HTTPError as e:
            return type(e).__name__
        if r.status_code != 200:
            self.details.add(f"HTTP {r.status_code}: {r.text[:160]}")
        return f"HTTP {r.status_code}"

    def probe(self) -> dict:
        """What a keyed bystander sees now from fresh channels: health and a 2-token Generate."""
        out = {}
        with grpc.insecure_channel(self.opts.grpc) as ch:
            for name, call in (
                    ("health", lambda: health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=5)),
                    ("generate", lambda: pagoda_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=[1, 2, 3], stopping=pb.StoppingCriteria(max_tokens=2)),
                        metadata=(("authorization", f"Bearer {self.opts.probe_key}"),), timeout=10))):
                started = time.monotonic()
                try:
                    call()
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                out[name] = f"{code} {time.monotonic() - started:.2f}s"
        return out

    def concurrently(self, jobs: list, probe_after: float = 1.0) -> dict:
        """Runs every job (a callable returning its outcome) at once; probes the bystander
        probe_after seconds in. The slowest job's seconds go in the record."""
        def timed(job) -> tuple[str, float]:
            started = time.monotonic()
            return job(), time.monotonic() - started
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(timed, job) for job in jobs]
            time.sleep(probe_after)
            probe = self.probe()
            results = [f.result() for f in futures]
        return {"codes": Counter(code for code, _ in results), "probe": probe,
                "seconds": round(max(s for _, s in results), 2)}

    # -- the attacks, in the order

    def half_open_grpc(self) -> dict:
        """1: calls that send headers and never their message, without a key."""
        calls = self.n(1100)
        conns = [H2Conn(self.grpc_port, "127.0.0.4") for _ in range((calls + 549) // 550)]
        for i, conn in enumerate(conns):
            conn.open_calls(min(550, calls - 550 * i), "Generate")
        # As a slot frees (a legitimate call ends) the refused calls are opened again, up to
        # as many more: the slots stay taken for the whole hold, as an attacker keeps them.
        started, reopened, probe = time.monotonic(), 0, {}
        while time.monotonic() - started < self.hold:
            refused = sum(c.seen["RST_STREAM"] for c in conns)
            if refused > reopened and reopened < calls:
                more = min(refused - reopened, calls - reopened)
                conns[reopened % len(conns)].open_calls(more, "Generate")
                reopened += more
            if not probe and time.monotonic() - started >= 1.0:
                probe = self.probe()
            time.sleep(0.2)
        seen = sum((c.seen for c in conns), Counter())
        for conn in conns:
            conn.close()
        return {"codes": {f"server sent {k}": v for k, v in seen.items()}, "probe": probe,
                "note": f"{calls} calls on {len(conns)} connections (and {reopened} again) held {self.hold:g} s"}

    def header_flood(self) -> dict:
        """2: one endless header line (even rounds) or endless short header lines (odd)."""
        lines = self.round % 2 == 1
        per_conn = self.n(32 * MB)
        deadline = time.monotonic() + self.hold

        def flood(i: int) -> str:
            sock = socket.create_connection(("127.0.0.1", self.http_port), source_address=(f"127.0.0.{5 + i % 4}", 0))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n" + (b"" if lines else b"X-Flood: "))
            chunk = b"X-F: a\r\n" * 8192 if lines else b"a" * 65536
            sent, outcome = 0, "held to the end"
            try:
                while sent < per_conn and time.monotonic() < deadline:
                    if select.select([sock], [], [], 0)[0]:
                        head = sock.recv(64)
                        outcome = ("HTTP " + head.split(b" ")[1].decode()) if head.startswith(b"HTTP/") else "closed"
                        break
                    sock.sendall(chunk)
                    sent += len(chunk)
                else:
                    outcome = "server took every byte" if sent >= per_conn else "held to the end"
            except OSError:
                outcome = "closed"
            sock.close()
            sent_mb[i] = sent / MB
            return outcome

        sent_mb: dict[int, float] = {}
        result = self.concurrently([lambda i=i: flood(i) for i in range(self.n(8))])
        kind = "short header lines" if lines else "one header line"
        return {**result, "note": f"{kind}: the server took {sum(sent_mb.values()):.0f} MB "
                                  f"from {len(sent_mb)} connections"}

    def abort_many_ids(self) -> dict:
        """3: one Abort of 22,000 ids of 256 characters."""
        ids = [f"{i:0256d}" for i in range(self.n(22_000))]
        return self.concurrently([lambda: self.grpc_call("Abort", pb.AbortRequest(request_ids=ids), 30)])

    def huge_token_ids(self) -> dict:
        """4: concurrent Generates of 6,000,000 prompt_token_ids each (2-byte varints: 12 MB)."""
        data = pb.GenerateRequest(prompt_token_ids=[300] * self.n(6_000_000),
                                  stopping=pb.StoppingCriteria(max_tokens=1)).SerializeToString()
        raw = self.channel.unary_unary(SERVICE + "Generate", request_serializer=lambda b: b,
                                       response_deserializer=pb.GenerateResponse.FromString)

        def send() -> str:
            try:
                raw(data, metadata=self.auth, timeout=60)
                return "OK"
            except grpc.RpcError as e:
                self.details.add(f"{e.code().name}: {(e.details() or '')[:160]}")
                return e.code().name
        return {**self.concurrently([send] * self.n(6)), "note": f"{len(data) / MB:.1f} MB each"}

    def deep_json(self) -> dict:
        """5: JSON nested 30,000 deep inside string fields (HTTP structured_outputs.json,
        response_format's schema, gRPC json_schema) and in a tool's parameters."""
        # The issue's 30,000, and 16,000 (32,000 bytes: inside --max-structured-output-bytes' default)
        depths = (self.n(30_000), self.n(16_000))
        body = {"model": self.model, "prompt": [5, 6, 7], "max_tokens": 2}
        schema = json.loads('{"type": "array", "items": ' * 900 + "{}" + "}" * 900)  # json.dumps' own limit
        jobs = [lambda d=d: f"structured_outputs.json {d} deep " + self.post("/v1/completions", {
                    **body, "structured_outputs": {"json": "[" * d + "]" * d}}) for d in depths]
        jobs += [lambda d=d: f"gRPC json_schema {d} deep " + self.grpc_call("Generate", pb.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], stopping=pb.StoppingCriteria(max_tokens=2), sampling=pb.SamplingParams(
                        structured_output=pb.StructuredOutput(json_schema="[" * d + "]" * d)))) for d in depths]
        nested = "[" * depths[0] + "]" * depths[0]
        jobs += [lambda: "response_format schema 900 deep " + self.post("/v1/completions", {
                    **body, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}),
                lambda: "gRPC tool parameters " + self.grpc_call("Generate", pb.GenerateRequest(
                    messages=[pb.ChatMessage(role="user", content="hi")], stopping=pb.StoppingCriteria(max_tokens=2),
                    tools=[pb.Tool(name="f", parameters='{"type": "object", "x": ' + nested + "}")]))]
        return self.concurrently(jobs, probe_after=0.5)

    def tokenize_max_code_points(self) -> dict:
        """6: Tokenize of 1 MB of U+10FFFF (and of a half MB), a few at once, over gRPC and HTTP."""
        prompt = "\U0010ffff" * self.n(MB // 4)
        jobs = []
        for chars in (len(prompt), len(prompt) // 2):
            message = pb.ChatMessage(role="user", content=prompt[:chars])
            jobs += [lambda c=chars: f"gRPC prompt {c} chars " + self.grpc_call(
                         "Tokenize", pb.TokenizeRequest(prompt=prompt[:c])),
                     lambda m=message: f"gRPC messages {len(m.content)} chars " + self.grpc_call(
                         "Tokenize", pb.TokenizeRequest(messages=[m]))]
        jobs *= self.n(2)
        # Raw UTF-8, just under --max-http-body-bytes' default (1 MiB); json.dumps would escape
        # each character into 12 bytes.
        body = json.dumps({"prompt": prompt[:MB // 4 - 16]}, ensure_ascii=False).encode()
        jobs.append(lambda: "HTTP /tokenize " + self.post("/tokenize", body))
        return self.concurrently(jobs)

    def grammar_flood(self) -> dict:
        """7: distinct slow-to-compile schemas at once, and tools with tool_choice none."""
        def schema(i: int) -> dict:  # nested counted repetitions: distinct (no cache hit), slow to compile
            return {"type": "object", "required": ["a"], "properties": {"a": {
                "type": "string", "pattern": f"r{self.round}x{i}(((ab|c){{1,20}}d){{1,20}}e){{1,20}}"}}}
        body = {"model": self.model, "prompt": [5, 6, 7], "max_tokens": 1}
        jobs = [lambda i=i: "response_format " + self.post("/v1/completions", {**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema(i)}}}) for i in range(self.n(24))]
        chat = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        jobs += [lambda i=i: "tools, tool_choice none " + self.post("/v1/chat/completions", {
            **chat, "tool_choice": "none", "tools": [{"type": "function", "function": {
                "name": f"f{k}", "parameters": schema(1000 * i + k)}} for k in range(8)]})
            for i in range(self.n(4))]
        return self.concurrently(jobs, probe_after=2.0)

    def wide_beams(self) -> dict:
        """8: beam searches of width 16, each counted once against the tenant's quota."""
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], beam_search=pb.BeamSearchParams(beam_width=16),
                                 stopping=pb.StoppingCriteria(max_tokens=64))
        return self.concurrently([lambda: self.grpc_call("Generate", req)] * self.n(8))

    def logprob_answers(self) -> dict:
        """9: whole answers with 20 logprobs a token."""
        req = pb.GenerateRequest(prompt_token_ids=[8, 9], sampling=pb.SamplingParams(logprobs=20, prompt_logprobs=20),
                                 stopping=pb.StoppingCriteria(max_tokens=1000, ignore_eos=True))
        return self.concurrently([lambda: self.grpc_call("Generate", req, 120)] * self.n(16), probe_after=3.0)

    def idle_sockets(self) -> dict:
        """10: idle unauthenticated sockets on both ports, past the connection caps."""
        held = []
        for i in range(self.n(1100)):
            for port in (self.http_port, self.grpc_port):
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=2,
                                                         source_address=(f"127.0.0.{10 + i % 50}", 0)))
                except OSError:
                    break
        for s in held[1::2]:  # the gRPC ones start HTTP/2 and stay silent
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0))
        time.sleep(1.0)
        probe = self.probe()
        try:
            status = f"HTTP {httpx2.get(self.http_base + '/v1/models', timeout=5, headers={'Authorization': f'Bearer {self.opts.probe_key}'}).status_code}"
        except httpx2.HTTPError as e:
            status = type(e).__name__
        probe["http models"] = status
        time.sleep(max(0.0, self.hold - 1.0))
        for s in held:
            s.close()
        return {"codes": {"sockets opened": len(held)}, "probe": probe}

    def request_ids(self) -> dict:
        """11: guess the sequential ids, abort a window around ours, and pre-claim the next."""
        stream = self.stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=[4], stopping=pb.StoppingCriteria(
            max_tokens=1)), metadata=self.auth, timeout=30)
        ours = next(iter(stream)).request_id
        prefix, _, n = ours.rpartition("-")
        if not n.isdigit():
            return {"codes": {"ids not sequential": 1}, "note": ours}
        window = [f"{prefix}-{k}" for k in range(max(0, int(n) - 200), int(n) + 200)]
        codes, aborted = Counter(), 0
        for key in (True, False):
            try:
                r = self.stub.Abort(pb.AbortRequest(request_ids=window), metadata=self.auth if key else None, timeout=10)
                aborted += len(r.request_ids)
                codes["abort " + ("keyed" if key else "unkeyed") + " OK"] += 1
            except grpc.RpcError as e:
                codes["abort " + ("keyed" if key else "unkeyed") + " " + e.code().name] += 1
        claims = [self.stub.GenerateStream(pb.GenerateRequest(
            request_id=f"{prefix}-{int(n) + k}", prompt_token_ids=[4], stopping=pb.StoppingCriteria(
                max_tokens=200, ignore_eos=True)), metadata=self.auth, timeout=self.hold) for k in range(1, 5)]
        time.sleep(min(3.0, self.hold))
        probe = self.probe()
        for call in claims:  # one that ended already was refused (ALREADY_EXISTS, ...)
            codes["pre-claim " + (call.code().name if call.done() else "held")] += 1
            call.cancel()
        return {"codes": codes, "probe": probe,
                "note": f"ids like {ours}; {aborted} of {len(window)} guessed ids aborted; 4 pre-claimed"}

    def probing(self) -> dict:
        """12: /metrics without a key, GetLoads with and without one."""
        codes, names = Counter(), set()
        r = httpx2.get(self.http_base + "/metrics", timeout=10)
        codes[f"/metrics unkeyed HTTP {r.status_code}"] += 1
        series = [line for line in r.text.splitlines() if not line.startswith("#")]
        workers = {line.split("{")[0] for line in series if "worker" in line}
        tenants = {line.split("{")[0] for line in series if "tenant" in line}
        for key in (False, True):
            try:
                loads = self.stub.GetLoads(pb.GetLoadsRequest(), metadata=self.auth if key else None, timeout=10)
                codes[f"GetLoads {'keyed' if key else 'unkeyed'} OK"] += 1
                names |= {w.worker_id for w in loads.workers}
            except grpc.RpcError as e:
                codes[f"GetLoads {'keyed' if key else 'unkeyed'} {e.code().name}"] += 1
        return {"codes": codes, "note": f"{len(r.content)} bytes of /metrics, {len(series)} series, "
                                        f"{len(workers)} metrics naming a worker, {len(tenants)} a tenant; "
                                        f"GetLoads named workers {sorted(names)}"}


ATTACKS = [("half_open_grpc", 1), ("header_flood", 2), ("abort_many_ids", 3), ("huge_token_ids", 4),
           ("deep_json", 5), ("tokenize_max_code_points", 6), ("grammar_flood", 7), ("wide_beams", 8),
           ("logprob_answers", 9), ("idle_sockets", 10), ("request_ids", 11), ("probing", 12)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", required=True, help="the gateway's gRPC address, HOST:PORT")
    ap.add_argument("--http", required=True, help="its HTTP address, HOST:PORT")
    ap.add_argument("--key", required=True, help="the attacker's own API key")
    ap.add_argument("--probe-key", required=True, help="another tenant's key, for the bystander probes only")
    ap.add_argument("--seconds", type=float, required=True, help="start no attack after this many seconds")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds an attack holds what it opened")
    ap.add_argument("--scale", type=float, default=1.0, help="times the issue's counts and sizes")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between attacks")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per attack")
    opts = ap.parse_args()
    attacker = Attacker(opts)
    deadline = time.monotonic() + opts.seconds
    with opts.out.open("a") as out:
        while time.monotonic() < deadline:
            for name, item in ATTACKS:
                if time.monotonic() >= deadline:
                    break
                started, attacker.details = time.time(), set()
                try:
                    result = getattr(attacker, name)()
                except Exception as e:  # noqa: BLE001 - one attack's failure is its outcome; the cycle goes on
                    result = {"codes": {f"attacker error {type(e).__name__}": 1}, "note": str(e)[:300]}
                result.update(attack=name, item=item, round=attacker.round, start=started, end=time.time())
                result["codes"] = dict(result.get("codes", {}))
                result["details"] = sorted(attacker.details)[:6]
                out.write(json.dumps(result) + "\n")
                out.flush()
                print(f"[attacks] {name}: {result['codes']} {result.get('probe', '')}", flush=True)
                time.sleep(opts.pause)
            attacker.round += 1


if __name__ == "__main__":
    main()
