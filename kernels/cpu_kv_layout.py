"""How the CPU backend lays out a K block: its keys transposed, [num_kv_heads, head_dim,
block_size], so that one block's scores are weighted sums of block_size-long rows
(kernels/cpu_attention.py says why). Every CPU attention path reads it: the torch ops, the
decode and prefill kernels (kernels/csrc/), their start-up checks and the fused decode step."""
from __future__ import annotations

import torch


def key_blocks(k_cache: torch.Tensor) -> torch.Tensor:
    """The K cache [num_blocks, block_size, num_kv_heads, head_dim] as this backend lays it out:
    [num_blocks, num_kv_heads, head_dim, block_size]. Block copies and swaps move whole blocks,
    so they need not know."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return k_cache.view(num_blocks, num_kv_heads, head_dim, block_size)
