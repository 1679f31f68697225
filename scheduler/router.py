"""The scheduler's view of the whole cluster: workers, their schedulers, and the gateways' requests.

Sockets stay in scheduler/server.py; this file is pure bookkeeping so it can be tested
in-process with a fake worker.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from proto import internal_pb2 as pb, pagoda_pb2
from proto.auth import PROTOCOL_VERSION
from scheduler import lost_steps
from scheduler.admission import Rejected, check_admission, seeded_sampling  # noqa: F401 - Rejected: the API
from scheduler.beam_search import BeamSearch
from scheduler.scheduler_config import RouterConfig, SchedulerConfig  # noqa: F401 - RouterConfig: the API
from scheduler.forks import Forks
from scheduler.reports import loads_of
from scheduler.request import FinishReason, Request, Status
from scheduler.scheduler import Scheduler
from scheduler.sequence_group import SequenceGroup
from scheduler.single import Single
from scheduler.stream import Streams
from scheduler.tenants import TenantLoad

log = logging.getLogger("pagoda.router")

FAILED_ALONE = "the worker failed every step that computed this sequence"


@dataclass
class WorkerState:
    worker_id: bytes
    hello: pb.WorkerHello
    scheduler: Scheduler
    last_seen: float = field(default_factory=time.monotonic)
    steps: int = 0
    forward_seconds: float = 0.0  # the worker's own time in execute, summed over steps

    @property
    def load(self) -> int:
        return len(self.scheduler.requests)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.workers: dict[bytes, WorkerState] = {}
        self.pending: list[Request] = []          # no worker can take them yet
        self.seqs: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.public: dict[str, str] = {}          # public (client) id -> request id, in flight
        self.tenants = TenantLoad(config.max_seqs_per_tenant)  # counts what seqs holds
        # Every registration's step ids start at its epoch << 32: ids never repeat across
        # registrations, so a late result of an earlier one is recognised and dropped.
        self.epochs = itertools.count(1)
        self.streams = Streams()  # every gateway's outbox (scheduler/stream.py)

    # -- workers ------------------------------------------------------------------------------
    def refusal(self, worker_id: bytes, hello: pb.WorkerHello) -> str | None:
        """Why this hello cannot join the cluster, or None. Every worker must stop sequences on
        the same tokens, or a stream's end would depend on where it was routed."""
        if not hello.eos_token_ids and not hello.no_eos:
            return ("the hello names no eos_token_ids and does not say the model has none "
                    "(no_eos): a worker that cannot tell where answers end would run every "
                    "answer to max_tokens")
        others = [w.hello for w in self.workers.values() if w.worker_id != worker_id]
        if others and hello.model != others[0].model:
            return (f"it serves model {hello.model!r}, the cluster {others[0].model!r} "
                    f"(worker {others[0].worker_id})")
        if others and hello.block_size != others[0].block_size:
            # Prefix-cache routing compares a request's block hashes across workers.
            return (f"its block_size {hello.block_size} differs from the cluster's "
                    f"{others[0].block_size} (worker {others[0].worker_id})")
        if others and set(hello.eos_token_ids) != set(others[0].eos_token_ids):
            return (f"its eos_token_ids {sorted(hello.eos_token_ids)} differ from the cluster's "
                    f"{sorted(others[0].eos_token_ids)} (worker {others[0].worker_id})")
        return None

    def register(self, worker_id: bytes, hello: pb.WorkerHello) -> None:
        """Call refusal() first."""
        if worker_id in self.workers:
            self.remove(worker_id, "registered again")
        cfg = SchedulerConfig(
            block_size=hello.block_size, max_model_len=hello.max_model_len,
            max_num_seqs=min(self.config.max_num_seqs,  # its plan size bound's
                             hello.max_num_seqs or self.config.max_num_seqs),
            # The worker sized its memory for steps of at most this many tokens.
            max_num_batched_tokens=min(self.config.max_num_batched_tokens,
                                       hello.max_num_batched_tokens or self.config.max_num_batched_tokens),
            max_plans_in_flight=self.config.max_plans_in_flight,
            num_speculative_tokens=hello.num_speculative_tokens,
            spec_disable_by_batch_size=hello.speculative_disable_by_batch_size,
            spec_paced_by_worker=hello.speculative_paced_by_worker,
            enable_prefix_caching=self.config.enable_prefix_caching,
            eos_token_ids=frozenset(hello.eos_token_ids),
            num_cpu_blocks=hello.num_cpu_blocks, bytes_per_block=hello.bytes_per_block,
            swap_bytes_per_s=hello.swap_bytes_per_s, prefill_tokens_per_s=hello.prefill_tokens_per_s)
        first_step_id = next(self.epochs) << 32
        self.workers[worker_id] = WorkerState(worker_id, hello,
                                              Scheduler(cfg, hello.num_blocks, first_step_id,
                                                        self.streams))
        log.info("worker %s registered: %d blocks of %d, max_model_len %d, %s",
                 hello.worker_id, hello.num_blocks, hello.block_size, hello.max_model_len,
                 hello.device)
        pending, self.pending = self.pending, []
        for req in pending:
            self._route(req.group)

    def remove(self, worker_id: bytes, why: str, step_lost: bool = False) -> None:
        """A lost worker's sequences are recomputed elsewhere from prompt plus the tokens already
        streamed, so their clients' streams just continue. step_lost: the worker died or hung
        in its running step, which counts against the sequences in it (lost_steps.py)."""
        state = self.workers.pop(worker_id, None)
        if state is None:
            return
        most = self.config.max_step_failures
        doomed = lost_steps.count_lost_step(state.scheduler.running_step, most) if step_lost else []
        orphans = state.scheduler.drain()
        log.warning("worker %s dropped (%s); %d sequences requeued",
                    state.hello.worker_id, why, len(orphans) - len(doomed))
        for req in orphans:
            if req not in doomed:
                self._route(req.group)
        for req in doomed:
            message = lost_steps.failed_message(req, most)
            log.error("%s: %s; ended with INTERNAL", req.seq_id, message)
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR
            self._emit(req, error=pb.Error(code="INTERNAL", message=message))

    def cluster_info(self) -> pb.ClusterInfo:
        if not self.workers:
            return pb.ClusterInfo(num_workers=0, protocol_version=PROTOCOL_VERSION)
        hellos = [w.hello for w in self.workers.values()]
        return pb.ClusterInfo(
            model=hellos[0].model, num_workers=len(hellos),
            max_model_len=min(h.max_model_len for h in hellos),
            block_size=hellos[0].block_size, vocab_size=hellos[0].vocab_size,
            total_blocks=max(h.num_blocks for h in hellos),
            eos_token_ids=sorted(hellos[0].eos_token_ids), protocol_version=PROTOCOL_VERSION,
            max_sequences=self.config.max_waiting_requests + sum(
                w.scheduler.config.max_num_seqs for w in self.workers.values()))

    # -- requests -----------------------------------------------------------------------------
    def add(self, gateway: bytes, add: pb.AddRequest) -> None:
        """Admit a request or raise Rejected: one that can never fit is refused now, not left
        waiting forever."""
        copies = check_admission(self, add)
        width = add.beam_search.beam_width
        n = 1 if width else max(1, add.n)  # a beam search is one handle (scheduler/beam_search.py)
        reqs = [Request(seq_id=f"{add.request_id}#0", request_id=add.request_id, index=0,
                        gateway=gateway, prompt_token_ids=list(add.prompt_token_ids),
                        sampling=seeded_sampling(add, 0), max_tokens=add.max_tokens,
                        ignore_eos=add.ignore_eos, stop_token_ids=frozenset(add.stop_token_ids),
                        priority=add.priority, arrival=self.tenants.tag(add.tenant, copies),
                        public_id=add.public_id, arrival_time=time.monotonic(),
                        cache_salt=add.cache_salt, tenant=add.tenant, final_only=add.final_only)]
        reqs += [reqs[0].derive(seq_id=f"{add.request_id}#{i}", index=i,
                                sampling=seeded_sampling(add, i)) for i in range(1, n)]
        for req in reqs:
            req.group = Single(req)  # each alone, unless they fork on one worker (below)
        if width:
            reqs[0].group = BeamSearch.of(reqs[0], add.beam_search)
        self.seqs[add.request_id] = reqs
        self.tenants.admit(reqs[0], copies)  # a beam search counts its width
        if add.public_id:
            self.public[add.public_id] = add.request_id
        if n == 1:
            self._route(reqs[0].group)
        # The n sequences share the prompt's blocks: the others fork sequence 0 once it has
        # computed the prompt, on the same worker. No worker for them now: each goes alone.
        elif not self._route(Forks(reqs[0], children=reqs[1:])):
            for req in reqs[1:]:
                self._route(req.group)

    def abort(self, request_id: str, indices=()) -> None:
        """The gateway gave up a request's sequences (the given indices, or all): free their
        blocks now. The gateway expects no answer."""
        seqs = self.seqs.get(request_id, [])
        chosen = [r for r in seqs if not indices or r.index in indices]
        if all(r.is_finished or r in chosen for r in seqs):
            self._forget(request_id)
        for req in chosen:
            self._end(req)

    def abort_public(self, public_ids) -> list[str]:
        """Abort by the clients' ids, whichever gateway streams them; each stream ends with
        ABORT. Returns the ids that were waiting, running or swapped."""
        found = []
        for public_id in public_ids:
            seqs = self.seqs.get(self.public.get(public_id, ""), [])
            live = [r for r in seqs if not r.is_finished]
            if live:
                found.append(public_id)
            for req in live:
                self._end(req)
                self._emit(req)
        return found

    def abort_gateway(self, gateway: bytes, error: pb.Error) -> int:
        """The gateway's lease lapsed: end every request it streams, freeing their blocks, each
        with `error` (delivered should the gateway still be there). Returns how many."""
        ids = [rid for rid, seqs in self.seqs.items() if seqs[0].gateway == gateway]
        self.end_requests(ids, error)
        return len(ids)

    def end_requests(self, ids, error: pb.Error) -> None:
        """End these requests' sequences with `error`, freeing their blocks."""
        for rid in ids:
            for req in self.seqs.get(rid, ()):
                if not req.is_finished:
                    self._end(req)
                    req.finish_reason = FinishReason.ERROR
                    self._emit(req, error=error)
            self._forget(rid)

    def refuse(self, gateway: bytes, request_id: str, error: pb.Error) -> None:
        """The answer to an add that never became a request. It waits in the gateway's outbox
        with the rest, so a burst of refusals leaves in a few messages, not one send each."""
        self.streams.refuse(gateway, request_id, error)

    def fail_pending(self, code: str, message: str) -> int:
        """End the sequences no worker has taken (none is left to take them)."""
        pending, self.pending = self.pending, []
        for req in pending:
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR
            self._emit(req, error=pb.Error(code=code, message=message))
        return len(pending)

    def _end(self, req: Request) -> None:
        state = self._worker_of(req)
        if state is not None:
            state.scheduler.abort(req.seq_id)
        elif req in self.pending:
            self.pending.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.ABORT

    def _forget(self, request_id: str) -> None:
        seqs = self.seqs.pop(request_id, None)
        if seqs:
            self.tenants.end(seqs[0])
            self.public.pop(seqs[0].public_id, None)

    def loads(self) -> pagoda_pb2.GetLoadsResponse:
        return loads_of(self.pending, self.workers.values())

    def call(self, call: pb.Call) -> pb.CallReply:
        reply = pb.CallReply(call_id=call.call_id)
        kind = call.WhichOneof("kind")
        if kind == "abort":
            reply.abort.request_ids.extend(self.abort_public(call.abort.request_ids))
        elif kind == "get_loads":
            reply.loads.CopyFrom(self.loads())
        return reply

    def _route(self, group: SequenceGroup) -> bool:
        """To the worker best placed for it. False: it waits for one (pending), or none can ever
        hold it (it ends RESOURCE_EXHAUSTED)."""
        req = group.handle
        if not self.workers:
            self.pending.append(req)
            return False
        # Only a worker whose whole pool can hold the sequences at their longest, or they would
        # wait (or be preempted) forever on a small worker while a big one could run them.
        states = [w for w in self.workers.values() if self._fits(w, req, group.seats)]
        if not states:
            req.status, req.finish_reason = Status.FINISHED, FinishReason.ERROR
            self._emit(req, error=pb.Error(code="RESOURCE_EXHAUSTED", message=(
                "no remaining worker's KV cache can hold prompt plus max_tokens")))
            return False
        least = min(states, key=lambda w: w.load)
        best, best_hits = least, 0
        if self.config.enable_prefix_caching and len(states) > 1:
            for w in states:
                hits = len(w.scheduler.kv.get_computed_blocks(req))
                if hits > best_hits:
                    best, best_hits = w, hits
            if best.load > least.load + self.config.load_slack:
                best = least
        req.worker = best.worker_id
        best.scheduler.add(group)
        return True

    @staticmethod
    def _fits(state: WorkerState, req: Request, copies: int) -> bool:
        sched = state.scheduler
        longest = min(req.num_prompt_tokens + req.max_tokens, sched.config.max_model_len)
        return sched.kv.blocks_for(longest) * copies <= sched.kv.num_blocks

    def _worker_of(self, req: Request) -> WorkerState | None:
        state = self.workers.get(req.worker) if req.worker is not None else None
        if state is not None and (req.seq_id in state.scheduler.requests
                                  or req.seq_id in state.scheduler.groups):
            return state
        return None

    # -- grammars (structured outputs; scheduler/grammar_waits.py) ------------------------------
    def grammar_requests(self) -> list[tuple[bytes, pb.CompileGrammars]]:
        """The grammars each worker must compile before its waiting sequences may run."""
        return [(w.worker_id, m) for w in self.workers.values() for m in w.scheduler.grammar_requests()]

    def on_compiled(self, worker_id: bytes, msg: pb.GrammarsCompiled) -> None:
        state = self.workers.get(worker_id)
        if state is not None:
            for req, why in state.scheduler.grammars_compiled(msg):
                self._emit(req, error=pb.Error(code="INVALID_ARGUMENT", message=why))

    # -- steps --------------------------------------------------------------------------------
    def plans(self) -> list[tuple[bytes, pb.StepPlan]]:
        """A plan for every worker that has work and room for one more plan in flight."""
        out = []
        for state in self.workers.values():
            if not state.scheduler.can_plan or not state.scheduler.has_work:
                continue
            plan = state.scheduler.schedule()
            if plan is not None:
                out.append((state.worker_id, plan))
        return out

    def on_result(self, worker_id: bytes, result: pb.StepResult) -> None:
        state = self.workers.get(worker_id)
        if state is None:
            return
        state.last_seen = time.monotonic()
        sched = state.scheduler
        oldest = sched.in_flight[0] if sched.in_flight else None
        if oldest is None or result.step_id < oldest.step_id:
            # From before this worker registered again, or a repeat: its plan is gone.
            log.warning("worker %s: dropped a stale result for step %d", state.hello.worker_id,
                        result.step_id)
            return
        state.steps += 1
        state.forward_seconds += result.forward_seconds
        if oldest.void:
            sched.update(result)  # drops it; its sequences were requeued
            return
        if result.error and result.step_id == oldest.step_id:
            # The worker's own text goes to the log only; the client gets a short message.
            log.error("worker %s step %d failed: %s", state.hello.worker_id, result.step_id,
                      result.error)
            for req in sched.fail_oldest():
                log.error("%s failed alone on worker %s: ended with INTERNAL", req.seq_id,
                          state.hello.worker_id)
                sched.finish(req, FinishReason.ERROR)
                self._emit(req, error=pb.Error(code="INTERNAL", message=FAILED_ALONE))
            return
        # The scheduler streams the tokens and ends (scheduler/stream.py); what ended comes
        # back to be forgotten.
        failed = sched.failed_rows(result)
        try:
            ended = sched.update(result)
        except ValueError as e:
            # The worker and its scheduler disagree about the batch: start that worker afresh
            # and recompute its sequences (elsewhere, or on it once it registers again).
            self.remove(worker_id, str(e))
            return
        for req in ended:
            self._ended(req)
        for req, why in failed:
            if req.status is Status.FINISHED:
                continue  # ended while the step ran (an abort)
            sched.finish(req, FinishReason.ERROR)
            self._emit(req, error=pb.Error(code="INVALID_ARGUMENT", message=why))

    def _emit(self, req: Request, error: pb.Error | None = None) -> None:
        """req ended outside a result (an abort, an error, no worker): its gateway is told."""
        req.group.report_end(self.streams, req, error)
        self._ended(req)

    def _ended(self, req: Request) -> None:
        seqs = self.seqs.get(req.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            self._forget(req.request_id)

    def take_outbox(self) -> dict[bytes, pb.SchedulerMessage]:
        """One message per gateway with everything since the last call."""
        return self.streams.take()
