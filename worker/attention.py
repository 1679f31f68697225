"""Paged attention as a layer: the step's K/V go into the cache, then attention over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.attention_backends import AttentionBackend


@dataclass
class AttentionMetadata:
    """Built once per step on the device and shared by every layer (shapes: kernels/reference.py)."""
    slot_mapping: torch.Tensor      # int64 [num_tokens]
    block_tables: torch.Tensor      # int32 [num_seqs, max_blocks], padded with 0
    seq_lens: torch.Tensor          # int32 [num_seqs], context including this step's tokens
    query_start_loc: torch.Tensor   # int32 [num_seqs + 1]
    max_seq_len: int                # host-side bounds, so that attention need not read the device
    max_query_len: int              # tensors back (a sync in every layer)
    plan: object = None             # the backend's own per-step indices, built by layer 0


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, meta, self.scale)
