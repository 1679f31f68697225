"""Paged attention as a layer: write this step's K/V into the cache, then attend over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.reference import Layout, prepare_layout
from kernels.select import AttentionBackend


@dataclass
class AttentionMetadata:
    """Built once per step on the device and shared by every layer (shapes: kernels/reference.py)."""
    slot_mapping: torch.Tensor      # int64 [num_tokens]
    block_tables: torch.Tensor      # int32 [num_seqs, max_blocks], padded with 0
    seq_lens: torch.Tensor          # int32 [num_seqs], context including this step's tokens
    query_start_loc: torch.Tensor   # int32 [num_seqs + 1]
    max_seq_len: int                # host-side bounds, so that attention need not read the device
    max_query_len: int              # tensors back (a sync in every layer)
    layout: Layout | None = None    # the torch backend's padded-batch indices, built by layer 0


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        extra = {}
        if self.backend.name == "torch":
            # The same for every layer of the step: build once, not 30 times.
            if meta.layout is None:
                meta.layout = prepare_layout(q.shape[0], k_cache.shape[1], meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc,
                                             meta.max_seq_len, meta.max_query_len)
            extra["layout"] = meta.layout
        return self.backend.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                            meta.query_start_loc, self.scale,
                                            max_seq_len=meta.max_seq_len,
                                            max_query_len=meta.max_query_len, **extra)
