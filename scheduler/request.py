"""A sequence as the scheduler sees it: token ids, progress and blocks. No tensors."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from proto import internal_pb2 as pb
from scheduler.draft_length import DraftLength
from scheduler.stream import Stream


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.IntEnum):
    LENGTH = pb.LENGTH
    STOP = pb.STOP
    ABORT = pb.ABORT
    ERROR = pb.ERROR


# What derive() carries over: the request's parameters and stop rule, never its progress.
_PARAMETERS = ("request_id", "index", "gateway", "prompt_token_ids", "sampling", "max_tokens",
               "ignore_eos", "stop_token_ids", "priority", "arrival", "public_id", "cache_salt",
               "tenant", "arrival_time", "stop_set", "length_limit", "min_stop_len", "worker",
               "final_only")


@dataclass(eq=False, slots=True)  # slots: attribute access in the per-step loops is faster
class Request:
    """One sequence. A request with n > 1 becomes n of these, with ids "<id>#<index>".

    There is no prefill or decode phase: num_computed_tokens chases num_tokens. That one rule
    covers chunked prefill, prefix hits and recompute after preemption.
    """
    seq_id: str
    request_id: str                 # the gateway's internal id, shared by the n sequences
    index: int
    gateway: bytes                  # ZeroMQ identity of the gateway that owns the stream
    prompt_token_ids: list[int]
    sampling: pb.SamplingConfig
    max_tokens: int
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival: int = 0                # a global counter: FCFS order within a priority
    public_id: str = ""             # the client's request id, unique in the cluster in flight
    cache_salt: str = ""            # prefix-cache hits only among requests with the same salt
    tenant: str = ""                # whose quota it counts against (scheduler/tenants.py)
    arrival_time: float = 0.0       # time.monotonic() at the scheduler
    queue_time: float = -1.0        # arrival to first scheduled, once known
    final_only: bool = False        # its tokens go out with its finish (AddRequest.final_only)

    all_token_ids: list[int] = field(default_factory=list)
    # Its progress, written by the verbs of scheduler/progress.py only:
    num_computed_tokens: int = 0    # including those of plans still on the worker
    num_pending: int = 0            # tokens sampled by plans in flight, not yet received
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks' tokens, once each
    num_cached_blocks: int = 0      # leading blocks registered in the prefix cache
    num_cached_tokens: int = -1     # the prefix hit at first admission (-1 = not admitted yet)
    status: Status = Status.WAITING  # on a worker, moved by scheduler/queues.py, which counts
    finish_reason: FinishReason | None = None

    # Set by set_limits() on arrival at a worker's scheduler: the token ids that stop it (EOS
    # unless ignore_eos, plus stop_token_ids) and the length at which it stops, so that the
    # per-token check is two comparisons.
    stop_set: frozenset[int] = frozenset()
    length_limit: int = 0
    min_stop_len: int = 0           # a stop token ends it only from this length on (min_tokens)
    worker: bytes | None = None     # the worker whose pool holds its blocks
    cpu_block_ids: list[int] = field(default_factory=list)  # while swapped out
    # The sequence group it belongs to (scheduler/sequence_group.py: a plain request is a group
    # of one), set by the router. Typed loosely: that module builds on this one.
    group: Any = None
    # What the worker already knows, so that a plan carries only the difference.
    on_worker: bool = False
    slot: int = -1                  # its name in plans and results while on the worker
    num_preemptions: int = 0
    # It was in a step that failed: it runs alone until a step with it succeeds, and ends with
    # INTERNAL if it fails alone (Scheduler.fail_oldest). It stays set across workers.
    suspect: bool = False
    # Steps that ran it and were lost with their worker (it died or hung in them), counted since
    # it last got further than before (scheduler/lost_steps.py), and how far it had got then.
    lost_steps: int = 0
    lost_at_length: int = -1
    # What its gateway was sent (scheduler/stream.py), made with it: never derived.
    stream: Stream | None = None
    # Speculative decoding: how many tokens it may propose next (scheduler/draft_length.py),
    # made at its first speculating step.
    draft: DraftLength | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.stream is None:
            self.stream = Stream(self.gateway, self.request_id, self.index, self.final_only)

    def derive(self, **changes) -> Request:
        """Another sequence of the same request (a beam, say): its parameters and stop rule,
        none of its progress, then `changes` (seq_id among them)."""
        fields = {name: getattr(self, name) for name in _PARAMETERS}
        fields.update(changes)
        return Request(**fields)

    def set_limits(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Its stop rule on a worker whose model ends answers with eos_token_ids."""
        eos = frozenset() if self.ignore_eos else eos_token_ids
        self.stop_set = eos | self.stop_token_ids
        # The first output token sits at index num_prompt_tokens; with min_tokens m, output
        # tokens 0..m-1 cannot stop it (the worker masks them, see SamplingConfig).
        self.min_stop_len = self.num_prompt_tokens + self.sampling.min_tokens + 1
        self.length_limit = min(self.num_prompt_tokens + self.max_tokens, max_model_len)

    def worker_sampling(self) -> pb.SamplingConfig:
        """What the worker samples it with, built for the plan that sends it: its own sampling
        (never edited), with the ids that stop it where the worker needs them: min_tokens masks
        them, and a grammar's complete answer may take only them (worker/grammar/matchers.py)."""
        sampling = self.sampling
        if not (sampling.min_tokens or sampling.HasField("structured_output")):
            return sampling
        out = pb.SamplingConfig()
        out.CopyFrom(sampling)
        out.stop_token_ids[:] = sorted(self.stop_set)
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival."""
        return (self.priority, self.arrival)
