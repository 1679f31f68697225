"""Tensor parallelism: one worker as N ranks in a torch.distributed group, split the Megatron way.

Each rank holds 1/N of every layer: the query, key and value heads (column-parallel QKV), the
gate/up columns (column-parallel), and the matching input columns of o_proj and down_proj
(row-parallel), whose partial outputs one all-reduce sums. A rank's KV cache holds its own KV
heads only. Embedding, norms and the LM head are replicated (docs/design.md says why); only
rank 0 computes logits and samples.

Rank 0 alone talks to the scheduler; it hands every plan to the others with a broadcast on the
control group (gloo, on the host), then after the forward broadcasts the tokens it sampled, so
that every rank's persistent batch stays the same. Any failed collective means a rank is gone
or the group is out of step: that is GroupLost, which ends the whole worker.
"""
from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta

import numpy as np
import torch
from torch import nn

from worker.model.config import ModelConfig
from worker.parallel.group_lost import GroupLost
from worker.model.layers import Linear, linear

# Control messages from rank 0: the plan to run, "forget every sequence", "still here" (sent
# while idle, so a waiting rank never reaches the timeout), and "exit".
PLAN, FORGET, KEEPALIVE, STOP = range(4)
# What a rank waits in one collective before the group counts as broken. It covers the skew of
# loading at start-up (three ranks loading on two cores); a rank that dies is noticed at once,
# from its closed connections, not by this.
COLLECTIVE_TIMEOUT_S = 300
FLAG = "--tensor-parallel-size"

# Checkpoint tensors split by rows (output features) and by columns (input features).
_COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW_PARALLEL = {"o_proj", "down_proj"}


def refusal(config: ModelConfig, size: int) -> str | None:
    """Why --tensor-parallel-size `size` cannot split this model, or None."""
    if size < 1:
        return f"{FLAG} must be at least 1, got {size}"
    parts = {"query heads": config.num_heads, "KV heads": config.num_kv_heads,
             "MLP columns (intermediate_size)": config.intermediate_size}
    broken = [f"{n} {what}" for what, n in parts.items() if n % size]
    if not broken:
        return None
    sizes = [d for d in range(1, math.gcd(*parts.values()) + 1)
             if not any(n % d for n in parts.values())]
    broken = ", ".join(broken[:-1]) + " and " + broken[-1] if len(broken) > 1 else broken[0]
    return (f"{FLAG} {size} does not divide the model's {broken}: every rank must hold whole "
            f"heads and an equal share of the MLP; sizes that work: {', '.join(map(str, sizes))}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's share: its heads and MLP columns; hidden size and vocabulary whole."""
    if why := refusal(config, size):
        raise ValueError(why)
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


@dataclasses.dataclass
class TensorParallel:
    """This process's place in its worker's group; rank 0 of size 1 (no group) by default."""
    rank: int = 0
    size: int = 1
    device_group: object = None   # the model's all-reduces: NCCL on CUDA, gloo on the CPU
    control_group: object = None  # plans and tokens, host tensors: always gloo

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor named as in HF (q_proj rows are whole heads,
        since heads are contiguous in them)."""
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if self.size == 1:
            return tensor
        if module in _COLUMN_PARALLEL:
            return tensor.chunk(self.size, 0)[self.rank]
        if module in _ROW_PARALLEL and parts[-1] == "weight":
            return tensor.chunk(self.size, 1)[self.rank]
        return tensor  # embeddings, norms, LM head, row-parallel biases: whole on every rank

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            _collective(torch.distributed.all_reduce, t, group=self.device_group)
        return t

    def min_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        if self.size > 1:
            _collective(torch.distributed.all_reduce, t, op=torch.distributed.ReduceOp.MIN,
                        group=self.control_group)
        return int(t)

    # ------------------------------------------------------------------ rank 0 -> the others

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: one control message to every other rank (nothing without a group)."""
        if self.size == 1:
            return
        self._broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64))
        if payload:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def receive(self) -> tuple[int, bytes]:
        """Ranks 1..N-1: the next control message from rank 0."""
        header = self._broadcast(torch.empty(2, dtype=torch.int64))
        kind, length = int(header[0]), int(header[1])
        payload = self._broadcast(torch.empty(length, dtype=torch.uint8)) if length else None
        return kind, b"" if payload is None else payload.numpy().tobytes()

    def send_tokens(self, tokens: np.ndarray | None) -> None:
        """Rank 0, after every forward: the sampled tokens, or None when sampling failed (the
        other ranks then fail the step too, so no rank advances its batch)."""
        if self.size == 1:
            return
        ok = tokens is not None
        body = torch.from_numpy(np.asarray(tokens if ok else [], np.int64))
        self._broadcast(torch.cat([torch.tensor([int(ok)]), body]))

    def receive_tokens(self, count: int) -> np.ndarray:
        t = self._broadcast(torch.empty(count + 1, dtype=torch.int64))
        if not int(t[0]):
            raise RuntimeError("rank 0 failed to sample this step")
        return t[1:].numpy()

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        _collective(torch.distributed.broadcast, t, src=0, group=self.control_group)
        return t


def _collective(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as e:  # gloo and NCCL errors (DistBackendError is a RuntimeError)
        raise GroupLost(str(e).splitlines()[0][:500]) from e


def init_group(rank: int, size: int, store, device: torch.device) -> TensorParallel:
    """Joins this worker's group through a TCPStore that rank 0 serves."""
    dist = torch.distributed
    # gloo listens on the address the host name resolves to, often the LAN's: keep it on
    # loopback, as every rank is on this host (its connections, like the store's, carry no
    # authentication).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    device_group = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else device_group
    return TensorParallel(rank, size, device_group, control)


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W split by input columns across ranks: each rank multiplies its part
    of x, one all-reduce sums them, and the bias (whole on every rank) is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: TensorParallel) -> nn.Linear:
    """An nn.Linear without a group, so that one rank computes exactly what it always did."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)
