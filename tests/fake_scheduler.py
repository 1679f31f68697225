"""A fake scheduler and an in-process gateway, for tests and for trying clients without workers.

The fake binds a real ZeroMQ ROUTER and speaks the real internal protocol, answering each
AddRequest with tokens cut from real tokenizer encodings (and Logprobs, when a plan says so),
and each Call (Abort by public id, GetLoads) as scheduler/router.py does. That isolates the
gateway's own logic (streaming, status codes, aborts, health) from the scheduler's.

    python -m tests.fake_scheduler [--address tcp://127.0.0.1:5555]   # then start gateway.main
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import Gateway
from gateway.scheduler_link.scheduler_client import SchedulerClient
from gateway.tokenizer import TextTokenizer, load_tokenizer
from proto import internal_pb2 as ipb, pagoda_pb2 as pb, pagoda_pb2_grpc
from proto.auth import PROTOCOL_VERSION
from proto.columns import pack, pack_f32
from proto.token_stream import Update, Writer
from tests.cluster import free_port

DEFAULT_REPLY = "Héllo 😀 wörld, 日本語 and 🇯🇵 done."

# A plan turns an AddRequest into steps: an `out` (tokens and/or news of one sequence), a
# TokenDelta (news alone) or a Logprobs to send, a float to sleep for, or None to wait until the
# request is aborted.
Plan = Callable[[ipb.AddRequest], list]


def out(request_id: str, token_ids: Sequence[int] = (), index: int = 0, **news) -> Update:
    """One sequence's tokens, then its news (finish, usage, error, ...) if any, as the real
    scheduler's stream sends them (scheduler/stream.py); the fake numbers the offsets."""
    delta = ipb.TokenDelta(request_id=request_id, index=index, **news)
    bare = delta == ipb.TokenDelta(request_id=request_id, index=index)
    return Update(request_id, index, 0, list(token_ids), None if bare else delta)


def logprobs_msg(request_id: str, first_position: int, token_ids: Sequence[int],
                 logprobs: Sequence[float], ranks: Sequence[int], top_token_ids: Sequence[int] = (),
                 top_logprobs: Sequence[float] = (), k: int = 0, index: int = 0,
                 prompt: bool = False) -> ipb.Logprobs:
    """A Logprobs message with its columns packed as the scheduler sends them."""
    return ipb.Logprobs(request_id=request_id, index=index, prompt=prompt,
                        first_position=first_position, token_ids=pack(token_ids),
                        logprobs=pack_f32(logprobs), ranks=pack(ranks), k=k,
                        top_token_ids=pack(top_token_ids), top_logprobs=pack_f32(top_logprobs))


def cluster_info(tok: TextTokenizer, num_workers: int = 1, max_model_len: int = 2048) -> ipb.ClusterInfo:
    return ipb.ClusterInfo(model=tok.name, num_workers=num_workers, max_model_len=max_model_len,
                           block_size=16, vocab_size=tok.vocab_size, total_blocks=1000,
                           eos_token_ids=tok.eos_token_ids, protocol_version=PROTOCOL_VERSION)


def reply_plan(tok: TextTokenizer, text: str = DEFAULT_REPLY, per_delta: int = 1,
               finish: int = ipb.LENGTH, delay: float = 0.0) -> Plan:
    """Every index streams `text`'s tokens, per_delta at a time, then finishes."""
    def plan(add: ipb.AddRequest) -> list:
        ids = tok.encode(text, add_special_tokens=False)
        per_index = []
        for index in range(max(1, add.n)):
            steps = [out(add.request_id, ids[i:i + per_delta], index)
                     for i in range(0, len(ids), per_delta)]
            steps[-1].news = ipb.TokenDelta(request_id=add.request_id, index=index, finish=finish,
                                            prompt_tokens=len(add.prompt_token_ids),
                                            cached_prompt_tokens=16)
            per_index.append(steps)
        # Interleave the indices, as a real scheduler batches them.
        steps = [d for step in zip(*per_index) for d in step]
        return [s for d in steps for s in ((delay, d) if delay else (d,))]
    return plan


@dataclass
class _Running:
    """An AddRequest whose plan is running."""
    peer: bytes
    add: ipb.AddRequest
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # wholly aborted
    aborted: set[int] = field(default_factory=set)   # indices the gateway aborted
    finished: set[int] = field(default_factory=set)  # indices whose finish went out

    def live(self) -> list[int]:
        return [i for i in range(max(1, self.add.n)) if i not in self.aborted | self.finished]


class FakeScheduler:
    """Answers hello with ClusterInfo, runs `plan` for each AddRequest and answers each Call;
    records what it got."""

    def __init__(self, tok: TextTokenizer, address: str = "tcp://127.0.0.1", num_workers: int = 1,
                 answer_hello: bool = True, max_model_len: int = 2048):
        self.tok = tok
        self.num_workers = num_workers
        self.max_model_len = max_model_len
        self.answer_hello = answer_hello
        self.plan: Plan = reply_plan(tok)
        self.loads = pb.GetLoadsResponse()  # what GetLoads answers
        self.adds: list[ipb.AddRequest] = []
        self.aborts: list[str] = []
        self.abort_indices: list[list[int]] = []  # per abort; [] = the whole request
        self.calls: list[ipb.Call] = []
        self.peers: set[bytes] = set()
        self.running: dict[str, _Running] = {}  # by internal request id
        self.public: dict[str, str] = {}  # public id -> internal id, while running
        self.epoch = random.getrandbits(63) + 1
        self.seqs: dict[bytes, int] = {}
        self.sent_tokens: dict[tuple[str, int], int] = {}
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address.count(":") < 2:  # no port given: take a free one
            address = f"{address}:{self.sock.bind_to_random_port(address)}"
        else:
            self.sock.bind(address)
        self.address = address
        self._tasks: list[asyncio.Task] = [asyncio.create_task(self._serve())]

    def info(self) -> ipb.ClusterInfo:
        return cluster_info(self.tok, self.num_workers, self.max_model_len)

    async def send_updates(self, peer: bytes, updates: Sequence[Update]) -> None:
        """Sequences' tokens and news in one message, in the token stream's encoding
        (proto/token_stream.py), each numbered from what its sequence was sent before."""
        writer = Writer()
        for u in updates:
            key = (u.request_id, u.index)
            u.offset = self.sent_tokens.get(key, 0)
            self.sent_tokens[key] = u.offset + len(u.token_ids)
            if u.news is not None:
                u.news.offset = self.sent_tokens[key]
            writer.put(u)
        await self.send(peer, writer.to_message(), numbered=True)

    async def send(self, peer: bytes, msg: ipb.SchedulerMessage, numbered: bool = False) -> None:
        """Numbers the message as the real scheduler does: epoch, the link's seq, and (unless
        numbered) each delta's offset (output tokens sent before it on its sequence)."""
        for d in msg.deltas if not numbered else ():
            d.offset = self.sent_tokens.get((d.request_id, d.index), 0)
        msg.epoch = self.epoch
        msg.seq = self.seqs[peer] = self.seqs.get(peer, 0) + 1
        await self.sock.send_multipart([peer, msg.SerializeToString()])

    async def set_workers(self, n: int) -> None:
        """Workers came or went: tell every gateway, as the real scheduler does."""
        self.num_workers = n
        for peer in self.peers:
            await self.send(peer, ipb.SchedulerMessage(info=self.info()))

    async def _serve(self) -> None:
        while True:
            peer, payload = await self.sock.recv_multipart()
            self.peers.add(peer)
            msg = ipb.GatewayMessage.FromString(payload)
            kind = msg.WhichOneof("kind")
            if kind == "hello" and self.answer_hello:
                await self.send(peer, ipb.SchedulerMessage(info=self.info()))
            elif kind == "add":
                await self._add(peer, msg.add)
            elif kind == "abort":
                self._abort(msg.abort)
            elif kind == "call":
                await self._call(peer, msg.call)

    async def _add(self, peer: bytes, add: ipb.AddRequest) -> None:
        self.adds.append(add)
        taken = (f"request_id {add.request_id!r} is already running" if add.request_id in self.running
                 else f"request_id {add.public_id!r} is already in flight; request ids must be "
                      "unique among running requests" if add.public_id in self.public else None)
        if taken is not None:  # as scheduler/router.py refuses it
            await self.send(peer, ipb.SchedulerMessage(deltas=[ipb.TokenDelta(
                request_id=add.request_id, finish=ipb.ERROR,
                error=ipb.Error(code="ALREADY_EXISTS", message=taken))]))
            return
        self.running[add.request_id] = _Running(peer, add)
        if add.public_id:
            self.public[add.public_id] = add.request_id
        self._tasks.append(asyncio.create_task(self._run(self.running[add.request_id])))

    def _abort(self, abort: ipb.AbortRequest) -> None:
        self.aborts.append(abort.request_id)
        self.abort_indices.append(sorted(abort.indices))
        run = self.running.get(abort.request_id)
        if run is not None:
            run.aborted.update(abort.indices or range(max(1, run.add.n)))
            if not run.live():
                run.stopped.set()

    async def _call(self, peer: bytes, call: ipb.Call) -> None:
        self.calls.append(call)
        reply = ipb.CallReply(call_id=call.call_id)
        kind = call.WhichOneof("kind")
        if kind == "abort":
            for public_id in call.abort.request_ids:
                run = self.running.get(self.public.get(public_id, ""))
                live = run.live() if run is not None else []
                if not live:
                    continue
                reply.abort.request_ids.append(public_id)
                run.stopped.set()
                run.finished.update(live)
                # The stream's ABORT goes out before the answer, as the real scheduler sends it.
                await self.send(run.peer, ipb.SchedulerMessage(deltas=[ipb.TokenDelta(
                    request_id=run.add.request_id, index=i, finish=ipb.ABORT,
                    prompt_tokens=len(run.add.prompt_token_ids)) for i in live]))
        elif kind == "get_loads":
            reply.loads.CopyFrom(self.loads)
        await self.send(peer, ipb.SchedulerMessage(replies=[reply]))

    async def _run(self, run: _Running) -> None:
        try:
            for step in self.plan(run.add):
                if run.stopped.is_set():
                    return
                if step is None:
                    await run.stopped.wait()
                    return
                if isinstance(step, float):
                    await asyncio.sleep(step)
                elif step.index in run.aborted:
                    continue  # the gateway gave up this sequence
                elif isinstance(step, ipb.Logprobs):
                    await self.send(run.peer, ipb.SchedulerMessage(logprobs=[step]))
                elif isinstance(step, Update):
                    if step.finish != ipb.NOT_FINISHED:
                        run.finished.add(step.index)
                    await self.send_updates(run.peer, [step])
                else:
                    if step.finish != ipb.NOT_FINISHED:
                        run.finished.add(step.index)
                    await self.send(run.peer, ipb.SchedulerMessage(deltas=[step]))
        finally:
            self.running.pop(run.add.request_id, None)
            if self.public.get(run.add.public_id) == run.add.request_id:
                del self.public[run.add.public_id]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()
        self._ctx.term()


def workers_of(client: SchedulerClient) -> int:
    """Workers the gateway's client knows of (0 before the scheduler answered)."""
    return client.info.num_workers if client.info is not None else 0


async def until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


class Harness:
    """A running fake scheduler + gateway + client channel."""

    def __init__(self, scheduler: FakeScheduler, gateway: Gateway, channel: grpc.aio.Channel):
        self.scheduler, self.gateway, self.channel = scheduler, gateway, channel
        self.stub = pagoda_pb2_grpc.GenerationStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI-compatible API (local_gateway(http=True))."""
        return f"http://127.0.0.1:{self.gateway.http_port}/v1"

    async def health_of(self, service: str = "") -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=service))).status

    async def stream(self, **kw) -> list[pb.GenerateResponse]:
        return [r async for r in self.stub.GenerateStream(pb.GenerateRequest(**kw))]


@contextlib.asynccontextmanager
async def local_gateway(tok: TextTokenizer, wait_ready: bool = True,
                        client: SchedulerClient | None = None,
                        scheduler: FakeScheduler | None = None, http: bool = False,
                        max_http_body_bytes: int = 1 << 20, api_keys: tuple[str, ...] = (),
                        **fake_kw):
    """A gateway on an ephemeral loopback port, wired to a fresh FakeScheduler, or to `scheduler`
    (another harness's: two gateways of one cluster), which it then leaves running."""
    owned = scheduler is None
    scheduler = scheduler if scheduler is not None else FakeScheduler(tok, **fake_kw)
    if client is not None:
        client.address = scheduler.address
    gateway = Gateway(tok, scheduler.address, port=0, client=client,
                      http_port=free_port() if http else 0, max_http_body_bytes=max_http_body_bytes,
                      api_keys=api_keys)
    port = await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        if wait_ready:
            await until(lambda: workers_of(gateway.client) >= 1)
        yield Harness(scheduler, gateway, channel)
    finally:
        await channel.close()
        await gateway.stop(0.5)
        if owned:
            await scheduler.close()


async def _serve_forever(address: str, model: str) -> None:
    scheduler = FakeScheduler(load_tokenizer(model), address=address)
    scheduler.plan = reply_plan(scheduler.tok, delay=0.05)
    print(f"fake scheduler on {scheduler.address}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await scheduler.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a fake pagoda scheduler (no workers needed)")
    parser.add_argument("--address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.address, args.model))
