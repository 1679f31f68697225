"""The attention backends: --attention-backend auto|triton|torch.

A backend is an object with one method, forward(q, k, v, kv_cache, meta, scale): it writes the
step's new keys and values into the layer's cache and returns the attention of every new token.
The model calls it without knowing which one it has. Whatever a backend derives from the step's
metadata alone it builds in the first layer and keeps in meta.plan for the others.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pagoda.kernels import cpu_attention
from worker.model.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float) -> torch.Tensor: ...


class TritonBackend:
    """The GPU kernels of kernels/triton_attention.py; the host-side hints spare a device sync."""
    name = "triton"

    def __init__(self) -> None:
        from pagoda.kernels import triton_attention  # imported late: Triton is heavy and GPU-bound
        self.kernels = triton_attention

    def forward(self, q, k, v, kv_cache, meta, scale):
        k_cache, v_cache = kv_cache
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                            meta.query_start_loc, scale, max_seq_len=meta.max_seq_len,
                                            max_query_len=meta.max_query_len)


class TorchBackend:
    """Plain torch (kernels/cpu_attention.py): the CPU path, K blocks in its own layout."""
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta, scale):
        k_cache, v_cache = kv_cache
        plan = self.plan(meta, k_cache, q.shape[1])
        cpu_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kernel=plan.kernel)
        return cpu_attention.paged_attention(q, k_cache, v_cache, plan, scale)

    @staticmethod
    def plan(meta, k_cache, num_q_heads: int) -> cpu_attention.AttentionPlan:
        """The step's plan, made by the first layer that asks and kept in meta for the others."""
        if meta.plan is None:
            meta.plan = cpu_attention.plan_attention(meta.block_tables, meta.seq_lens,
                                                     meta.query_start_loc, k_cache, num_q_heads)
        return meta.plan


def select_backend(name: str, device_type: str) -> AttentionBackend:
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"--attention-backend must be auto, triton or torch, not {name!r}")
    if name == "triton" or (name == "auto" and device_type == "cuda"):
        return TritonBackend()
    return TorchBackend()
