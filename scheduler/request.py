"""A sequence as the scheduler sees it: token ids, progress and blocks. No tensors."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proto import internal_pb2 as pb, pagoda_pb2

if TYPE_CHECKING:
    from scheduler.beam import BeamGroup


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

    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0    # including those of plans still on the worker
    num_pending: int = 0            # tokens sampled by plans in flight, not yet received
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks' tokens, once each
    num_cached_blocks: int = 0      # leading blocks registered in the prefix cache
    num_cached_tokens: int = -1     # the prefix hit at first admission (-1 = not admitted yet)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    # Set by the worker's scheduler on arrival: the token ids that stop it (EOS unless
    # ignore_eos, plus stop_token_ids) and the length at which it stops, so that the per-token
    # check is two comparisons.
    stop_set: frozenset[int] = frozenset()
    length_limit: int = 0
    min_stop_len: int = 0           # a stop token ends it only from this length on (min_tokens)
    worker: bytes | None = None     # the worker whose pool holds its blocks
    cpu_block_ids: list[int] = field(default_factory=list)  # while swapped out
    # n > 1: sequence 0 computes the prompt, then the others fork its blocks (copy-on-write).
    fork_children: list["Request"] = field(default_factory=list)
    fork_parent: "Request | None" = None
    # What the worker already knows, so that a plan carries only the difference.
    on_worker: bool = False
    slot: int = -1                  # its name in plans and results while on the worker
    num_preemptions: int = 0
    # It was in a step that failed: it runs alone until a step with it succeeds, and ends with
    # INTERNAL if it fails alone (scheduler/failures.py).
    suspect: bool = False
    # Steps that ran it and were lost with their worker (it died or hung in them), counted since
    # it last got further than before (scheduler/lost_steps.py), and how far it had got then.
    lost_steps: int = 0
    lost_at_length: int = -1
    # Streaming to the gateway: whether the first delta (with usage) went out, and how many
    # tokens at the end are not sent yet. A plain decode leaves both alone, so a quiet step
    # writes nothing here.
    stream_started: bool = False
    num_unstreamed: int = 0
    # Beam search (scheduler/beam.py): the group of a beam, and of the router's handle of the
    # request (which carries beam_params and is never in the batch); a beam's cumulative logprob
    # and whether its last token, the scheduler's choice, is still to be named in a plan.
    beam: "BeamGroup | None" = None
    beam_params: pagoda_pb2.BeamSearchParams | None = None
    cum_logprob: float = 0.0
    token_unsent: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

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
