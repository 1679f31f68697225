"""Whether the router can take a request at all: refused now rather than left waiting forever."""
from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol

from proto import internal_pb2 as pb
from scheduler.request import Status

if TYPE_CHECKING:
    from scheduler.scheduler_config import RouterConfig
    from scheduler.tenants import TenantLoad


class Cluster(Protocol):
    """What admission reads of the router (scheduler/router.py)."""
    config: RouterConfig
    seqs: Mapping[str, Any]     # request id -> its sequences, in flight
    public: Mapping[str, str]   # the clients' ids in flight
    pending: Sized              # sequences no worker has taken yet
    workers: Mapping[bytes, Any]  # WorkerStates: their hello and scheduler
    tenants: TenantLoad

    def end_requests(self, ids, error: pb.Error) -> None: ...


class Rejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_admission(router: Cluster, add: pb.AddRequest) -> int:
    """Raises Rejected for a request the cluster cannot take; returns how many sequences' blocks
    it may hold at worst (n, or beam_width: beams share blocks, but may each hold their own)."""
    if add.request_id in router.seqs:
        raise Rejected("ALREADY_EXISTS", f"request_id {add.request_id!r} is already running")
    if add.public_id and add.public_id in router.public:
        raise Rejected("ALREADY_EXISTS", f"request_id {add.public_id!r} is already in flight; "
                                         "request ids must be unique among running requests")
    if not add.prompt_token_ids:
        raise Rejected("INVALID_ARGUMENT", "prompt is empty")
    n = max(1, add.n)
    width = add.beam_search.beam_width
    if width > router.config.max_num_seqs:
        raise Rejected("INVALID_ARGUMENT", f"beam_search.beam_width {width} exceeds "
                                           f"--max-num-seqs {router.config.max_num_seqs}")
    copies = width or n  # beams share blocks, but may each hold their own at worst
    if router.workers:
        # What cluster_info() says, without building it: this runs for every add of a flood.
        hellos = [w.hello for w in router.workers.values()]
        max_model_len = min(h.max_model_len for h in hellos)
        total_blocks = max(h.num_blocks for h in hellos)
        total = len(add.prompt_token_ids) + add.max_tokens
        if total > max_model_len:
            raise Rejected("INVALID_ARGUMENT",
                           f"prompt ({len(add.prompt_token_ids)} tokens) plus max_tokens "
                           f"({add.max_tokens}) exceeds max_model_len {max_model_len}")
        blocks = -(-total // hellos[0].block_size) * copies
        if blocks > total_blocks:
            raise Rejected("INVALID_ARGUMENT",
                           f"prompt plus max_tokens needs {blocks} KV blocks for "
                           f"{f'beam_width={width}' if width else f'n={n}'}, "
                           f"but a worker holds only {total_blocks}")
    if why := router.tenants.refusal(add.tenant, copies):
        raise Rejected("RESOURCE_EXHAUSTED", why)
    num_waiting = len(router.pending) + sum(w.scheduler.num_waiting for w in router.workers.values())
    need = num_waiting + n - router.config.max_waiting_requests
    if need > 0 and not push_out(router, add.tenant, copies, need):
        raise Rejected("RESOURCE_EXHAUSTED",
                       f"the waiting queue is full ({num_waiting} waiting, "
                       f"--max-waiting-requests {router.config.max_waiting_requests})")
    return copies


PUSHED_OUT = ("the waiting queue is full and another tenant's request took this one's place "
              "(each tenant keeps a fair share of it); retry later")


def push_out(router: Cluster, tenant: str, n: int, need: int) -> bool:
    """The waiting queue is full and `tenant` asks for n sequences: end the newest waiting
    requests of the tenant holding the most, so that `need` sequences' room is free, if that
    tenant keeps at least as many as `tenant` will hold (else the next that does and has enough
    waiting). A share shrinks only while others wait; False (nothing ended) when `tenant` holds
    its share already."""
    held = router.tenants.in_flight
    for victim in sorted((t for t in held if t != tenant), key=held.__getitem__, reverse=True):
        if held[tenant] + n > held[victim] - n:
            return False  # nor any after it: they hold fewer
        chosen, freed = [], 0
        for handle in router.tenants.newest_waiting(victim):
            chosen.append(handle.request_id)
            freed += sum(r.status is Status.WAITING for r in router.seqs.get(handle.request_id, ()))
            if freed >= need:
                router.end_requests(chosen, pb.Error(code="RESOURCE_EXHAUSTED", message=PUSHED_OUT))
                return True
    return False


def seeded_sampling(add: pb.AddRequest, index: int) -> pb.SamplingConfig:
    """Sequence `index`'s own sampling: n seeded draws are distinct."""
    sampling = pb.SamplingConfig()
    sampling.CopyFrom(add.sampling)
    if sampling.has_seed:
        sampling.seed = (sampling.seed + index) & (2 ** 64 - 1)
    return sampling
