"""Structured outputs' token mask applied to float32 logits on the CPU (kernels/csrc/grammar_mask.c),
with its reference: the bitmask unpacked by torch. The layout is xgrammar's (bit j of word w of a
row allows token 32 w + j); the kernel knows no grammar.

masked() returns a new tensor: the caller keeps the raw logits (logprobs are the raw model's).
Where the library cannot be built or the logits are not float32 on the CPU, xgrammar's own kernel
does the work."""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "grammar_mask.c"
FLAGS = ["-O3", "-shared", "-fPIC"]

_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_mask_isa", "pagoda_mask_rows",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
     ctypes.c_int64, ctypes.c_int64, ctypes.c_int],
    {1: "portable C"}, "using xgrammar's")
available = _kernel.available


def _mask_rows(out: torch.Tensor, index: torch.Tensor, bitmask: torch.Tensor) -> None:
    _kernel.fn(out.data_ptr(), out.stride(0), index.data_ptr(), len(index), bitmask.data_ptr(),
               bitmask.shape[1], out.shape[1], _kernel.best)


def agrees_with_reference() -> bool:
    """The kernel against reference() on random logits and masks, a partial last word included
    (the start-up check)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    out, index = logits.clone(), torch.tensor([2, 0], dtype=torch.int64)
    _mask_rows(out, index, bitmask)
    return torch.equal(out, reference(logits, [2, 0], bitmask))


_kernel.check = agrees_with_reference


def masked(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [S, V] with -inf where row rows[i]'s mask (bitmask[i]) forbids a token."""
    out = logits.clone()
    if not rows:
        return out
    bitmask = bitmask.to("cpu").contiguous()
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.stride(1) == 1 \
            and bitmask.dtype == torch.int32 and available():
        _mask_rows(out, torch.tensor(list(rows), dtype=torch.int64), bitmask)
        return out
    import xgrammar as xgr
    index = torch.tensor(list(rows), device=out.device)
    x = out[index]
    xgr.apply_token_bitmask_inplace(x, bitmask.to(out.device), vocab_size=out.shape[1])
    return out.index_copy_(0, index, x)


def reference(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """masked() by unpacking every bit with torch."""
    vocab = logits.shape[1]
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    out = logits.clone()
    for i, r in enumerate(rows):
        out[r] = out[r].masked_fill(~allowed[i], float("-inf"))
    return out
