"""Picks the attention functions for a device: --attention-backend auto|triton|torch."""
from __future__ import annotations

from typing import Callable, NamedTuple


class AttentionBackend(NamedTuple):
    name: str
    write_kv: Callable
    paged_attention: Callable


def select_backend(name: str, device_type: str) -> AttentionBackend:
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"--attention-backend must be auto, triton or torch, not {name!r}")
    use_triton = name == "triton" or (name == "auto" and device_type == "cuda")
    if use_triton:
        from kernels import triton_attention as t  # imported late: Triton is heavy and GPU-bound
        return AttentionBackend("triton", t.write_kv, t.paged_attention)
    from kernels import reference as r
    return AttentionBackend("torch", r.write_kv, r.paged_attention)
