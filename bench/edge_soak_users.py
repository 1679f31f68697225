"""The edge soak's legitimate traffic (bench/edge_soak.py) as locust users: two tenants, each
over gRPC and over HTTP, each request streamed or unary, structured (a small JSON schema) or
plain. Every request is timed from its send to its last byte and reported through locust's
request event, with the tenant, the kind and, for streams, the time to the first token in its
context; a request that is not served gets an exception naming its cause ("grpc
RESOURCE_EXHAUSTED", "HTTP 503", "aborted", a transport error), which the soak counts.

bench/edge_soak.py drives it as a library (configure(), then USERS). It also runs as a
locustfile against a running stack, reading the same settings from the environment:

    PAGODA_SOAK_GRPC=127.0.0.1:50051 PAGODA_SOAK_HTTP=127.0.0.1:8000 PAGODA_SOAK_KEYS=keyA,keyB \\
        .venv/bin/locust -f bench/edge_soak_users.py --headless -u 8 -r 4 -t 5m
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import User, between, task  # locust first: it patches the standard library for gevent

import grpc
import grpc.experimental.gevent as grpc_gevent
import requests

from proto import pagoda_pb2 as pb, pagoda_pb2_grpc

grpc_gevent.init_gevent()  # gRPC's own threads would otherwise block every greenlet

CONFIG = {"grpc": os.environ.get("PAGODA_SOAK_GRPC", "127.0.0.1:50051"),
          "http": os.environ.get("PAGODA_SOAK_HTTP", "127.0.0.1:8000"),
          "keys": os.environ.get("PAGODA_SOAK_KEYS", "keyA,keyB").split(","),
          "model": os.environ.get("PAGODA_SOAK_MODEL", ""), "max_tokens": 16,
          # Off: prompts of token ids (the fake worker's vocabulary is 1,000 ids, which chat
          # templates leave), over /v1/completions; on: chat messages, over /v1/chat/completions.
          "chat": os.environ.get("PAGODA_SOAK_CHAT", "1") == "1"}
TENANTS = ("A", "B")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}}
PROMPTS = ["Name a river.", "Write one short sentence about trees.", "Count to five.",
           "What is the capital of France?"]


def configure(grpc_target: str, http_target: str, keys: list[str], model: str, max_tokens: int,
              chat: bool) -> None:
    CONFIG.update(grpc=grpc_target, http=http_target, keys=keys, model=model, max_tokens=max_tokens, chat=chat)


def prompt_ids() -> list[int]:
    return [random.randrange(10, 1000) for _ in range(8)]


class Refused(Exception):
    """A legitimate request that was not served: its cause (str) and the server's message."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(cause)
        self.detail = detail


class Tenant(User):
    abstract = True
    tenant = "A"
    protocol = ""
    wait_time = between(0.2, 1.0)

    @property
    def key(self) -> str:
        return CONFIG["keys"][TENANTS.index(self.tenant)]

    def record(self, stream: bool, structured: bool, send) -> None:
        """Runs send() (which returns the seconds to its first token, or None) and reports it."""
        kind = f"{'stream' if stream else 'unary'} {'structured' if structured else 'plain'}"
        started, error, first = time.perf_counter(), None, None
        try:
            first = send()
        except Refused as e:
            error = e
        except (grpc.RpcError, requests.RequestException, ValueError, LookupError) as e:  # transport, malformed
            error = Refused(type(e).__name__, str(e)[:200])
        self.environment.events.request.fire(
            request_type=self.protocol, name=f"{self.tenant} {self.protocol} {kind}",
            response_time=(time.perf_counter() - started) * 1000, response_length=0, exception=error,
            context={"tenant": self.tenant, "protocol": self.protocol, "kind": kind,
                     "detail": error.detail if error else None,
                     "ttft_ms": None if first is None else first * 1000})

    @task
    def unary_plain(self) -> None:
        self.record(False, False, lambda: self.send(False, False))

    @task
    def stream_plain(self) -> None:
        self.record(True, False, lambda: self.send(True, False))

    @task
    def unary_structured(self) -> None:
        self.record(False, True, lambda: self.send(False, True))

    @task
    def stream_structured(self) -> None:
        self.record(True, True, lambda: self.send(True, True))

    def send(self, stream: bool, structured: bool) -> float | None:
        raise NotImplementedError


class GrpcTenant(Tenant):
    abstract = True
    protocol = "grpc"

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(CONFIG["grpc"])
        self.stub = pagoda_pb2_grpc.GenerationStub(self.channel)

    def on_stop(self) -> None:
        self.channel.close()

    def send(self, stream: bool, structured: bool) -> float | None:
        sampling = pb.SamplingParams(temperature=0)
        if structured:
            sampling.structured_output.json_schema = json.dumps(SCHEMA)
        req = pb.GenerateRequest(sampling=sampling, stopping=pb.StoppingCriteria(max_tokens=CONFIG["max_tokens"]))
        if CONFIG["chat"]:
            req.messages.add(role="user", content=random.choice(PROMPTS))
        else:
            req.prompt_token_ids.extend(prompt_ids())
        metadata, started, first = (("authorization", f"Bearer {self.key}"),), time.perf_counter(), None
        try:
            if stream:
                finish = pb.FINISH_REASON_UNSPECIFIED
                for r in self.stub.GenerateStream(req, metadata=metadata, timeout=120):
                    first = first or time.perf_counter() - started
                    finish = r.finish_reason or finish
            else:
                finish = self.stub.Generate(req, metadata=metadata, timeout=120).finish_reason
        except grpc.RpcError as e:
            raise Refused(f"grpc {e.code().name}", (e.details() or "")[:200]) from None
        if finish == pb.FINISH_REASON_ABORT:
            raise Refused("aborted", "finish_reason ABORT")
        return first


class HttpTenant(Tenant):
    abstract = True
    protocol = "http"

    def on_start(self) -> None:
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {self.key}"

    def on_stop(self) -> None:
        self.session.close()

    def send(self, stream: bool, structured: bool) -> float | None:
        body = {"model": CONFIG["model"], "max_tokens": CONFIG["max_tokens"], "temperature": 0, "stream": stream}
        if CONFIG["chat"]:
            body["messages"] = [{"role": "user", "content": random.choice(PROMPTS)}]
        else:
            body["prompt"] = prompt_ids()
        if structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        started, first, finish = time.perf_counter(), None, None
        route = "/v1/chat/completions" if CONFIG["chat"] else "/v1/completions"
        with self.session.post(f"http://{CONFIG['http']}{route}", json=body, stream=stream, timeout=120) as r:
            if r.status_code != 200:
                raise Refused(f"HTTP {r.status_code}", r.text[:200])
            if not stream:
                finish = r.json()["choices"][0]["finish_reason"]
            for line in r.iter_lines() if stream else ():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "choices" not in event:  # the stream's error event
                    raise Refused("error in stream", line[:200].decode(errors="replace"))
                first = first or time.perf_counter() - started
                choice = event["choices"]
                finish = (choice[0].get("finish_reason") if choice else None) or finish
        if finish not in ("stop", "length"):
            raise Refused(f"finish {finish}", f"finish_reason {finish!r}")
        return first


class GrpcA(GrpcTenant):
    tenant = "A"


class GrpcB(GrpcTenant):
    tenant = "B"


class HttpA(HttpTenant):
    tenant = "A"


class HttpB(HttpTenant):
    tenant = "B"


USERS = [GrpcA, GrpcB, HttpA, HttpB]
