"""Structured outputs' token mask applied to float32 logits on the CPU (kernels/csrc/grammar_mask.c),
with its reference: the bitmask unpacked by torch. The layout is xgrammar's (bit j of word w of a
row allows token 32 w + j); the kernel knows no grammar.

masked() returns a new tensor: the caller keeps the raw logits (logprobs are the raw model's).
Where the library cannot be built or the logits are not float32 on the CPU, xgrammar's own kernel
does the work."""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Sequence

import torch

from kernels import cbuild

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "grammar_mask.c"
FLAGS = ["-O3", "-shared", "-fPIC"]

_fn = None
_tried = False


def available() -> bool:
    global _fn, _tried
    if not _tried:
        _tried = True
        try:
            lib = ctypes.CDLL(str(cbuild.build(SOURCE, FLAGS)))
        except (OSError, RuntimeError) as e:
            logger.warning("grammar mask kernel off, using xgrammar's: %s", e)
            return False
        fn = lib.pagoda_mask_rows
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        fn.restype = None
        _fn = fn
        if not agrees_with_reference():
            logger.warning("the grammar mask kernel disagrees with its reference on this machine: "
                           "it is off, using xgrammar's")
            _fn = None
    return _fn is not None


def agrees_with_reference() -> bool:
    """The kernel against reference() on random logits and masks, a partial last word included
    (the start-up check)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    out, index = logits.clone(), torch.tensor([2, 0], dtype=torch.int64)
    _fn(out.data_ptr(), out.stride(0), index.data_ptr(), 2, bitmask.data_ptr(), bitmask.shape[1], out.shape[1])
    return torch.equal(out, reference(logits, [2, 0], bitmask))


def masked(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [S, V] with -inf where row rows[i]'s mask (bitmask[i]) forbids a token."""
    out = logits.clone()
    if not rows:
        return out
    bitmask = bitmask.to("cpu").contiguous()
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.stride(1) == 1 \
            and bitmask.dtype == torch.int32 and available():
        index = torch.tensor(list(rows), dtype=torch.int64)
        _fn(out.data_ptr(), out.stride(0), index.data_ptr(), len(rows), bitmask.data_ptr(),
            bitmask.shape[1], out.shape[1])
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
