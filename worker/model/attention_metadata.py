"""What every attention layer of one step reads: built once per step by the input batch, passed
to the backends (worker/model/attention_backends.py) through the model's layers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
