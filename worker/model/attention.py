"""Paged attention as a layer: the step's K/V go into the cache, then attention over it."""
from __future__ import annotations

import torch
from torch import nn

from worker.model.attention_backends import AttentionBackend
from worker.model.attention_metadata import AttentionMetadata


class PagedAttention(nn.Module):
    def __init__(self, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.backend = backend
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, meta, self.scale)
