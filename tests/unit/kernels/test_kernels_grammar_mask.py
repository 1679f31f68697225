"""kernels/grammar_mask.py against two references: the bitmask unpacked bit by bit with torch,
and xgrammar's own kernel, on masks of every shape a grammar makes (mostly forbidden, mostly
allowed, random, a vocabulary that is not a multiple of 32, a few rows of a larger batch)."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pagoda.kernels import grammar_mask


def _xgrammar(logits, rows, bitmask):
    out = logits.clone()
    index = torch.tensor(rows)
    x = out[index]
    xgr.apply_token_bitmask_inplace(x, bitmask, vocab_size=logits.shape[1])
    return out.index_copy_(0, index, x)


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
@pytest.mark.parametrize("kind", ["random", "mostly forbidden", "mostly allowed", "none allowed"])
def test_the_kernel_masks_exactly_what_the_bitmask_forbids(vocab, kind):
    assert grammar_mask.available()  # this machine builds it: the test must not pass by fallback
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g)
    raw = logits.clone()
    rows = [0, 3, 4, 11]
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    if kind == "mostly forbidden":
        bitmask &= torch.randint(0, 2, bitmask.shape, generator=g, dtype=torch.int32) * -1
        bitmask[:, 1:] = 0
    elif kind == "mostly allowed":
        bitmask[:, ::3] = -1
        bitmask[:, 1::3] |= 0x7fffffff
    elif kind == "none allowed":
        bitmask.zero_()
    out = grammar_mask.masked(logits, rows, bitmask)
    assert torch.equal(logits, raw)  # the raw logits stay
    assert torch.equal(out, grammar_mask.reference(logits, rows, bitmask))
    if vocab % 32 == 0:  # xgrammar's CPU kernel writes past a row for bits beyond the vocabulary
        assert torch.equal(out, _xgrammar(logits, rows, bitmask))
    others = [r for r in range(12) if r not in rows]
    assert torch.equal(out[others], raw[others])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [49152, 1000])
def test_cuda_logits_take_xgrammars_kernel_and_match_the_reference(vocab):
    """On CUDA the worker's float32 logits stay on the device and xgrammar's GPU kernel masks
    them (masked()'s other branch, never run on the CPU): the same tokens as the reference, the
    raw logits and the unconstrained rows untouched."""
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(12, vocab, generator=g)
    rows = [0, 3, 4, 11]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32,
                            generator=g)
    bitmask[1] = 0                                                 # a row that allows nothing
    on_gpu = logits.cuda()
    out = grammar_mask.masked(on_gpu, rows, bitmask)
    assert out.is_cuda and torch.equal(on_gpu.cpu(), logits)
    assert torch.equal(out.cpu(), grammar_mask.reference(logits, rows, bitmask))
