"""Paged causal attention in C for prefill chunks (kernels/csrc/cpu_prefill_attention.c): every
sequence with many new tokens in one call a layer, reading the cache where it lies (K blocks in
kernels/cpu_attention.py's transposed layout), fp32 or bf16, q and out in the model's dtype.
kernels/cpu_attention.py takes it for those sequences where it runs; torch's SDPA over a
gathered copy stays for the other dtypes, shapes and CPUs.

The instruction set is chosen at run time, as the decode kernel's (whose flags and dtype codes it
shares): AMX tiles for a bf16 cache and queries (kernels/csrc/cpu_prefill_attention_amx.h), else
AVX-512F, else AVX2 + FMA, else none (available() is False).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagoda.kernels import cbuild
from pagoda.kernels.cpu_decode_attention import DTYPES, FLAGS
from pagoda.kernels.cpu_kv_layout import key_blocks

# AMX-BF16 computes a bf16 cache with bf16 queries on the tiles; other dtypes take AVX-512F there.
ISA_NAMES = {3: "AMX-BF16", 2: "AVX-512F", 1: "AVX2+FMA"}

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_prefill_attention.c"

_c = ctypes
_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_prefill_attention_isa", "pagoda_prefill_attention",
    [_c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_int, _c.c_void_p,
     _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_int64, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_float,
     _c.c_int, _c.c_int],
    ISA_NAMES, "prefill attention by torch's SDPA")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


def runs_on(k_cache: torch.Tensor, num_q_heads: int) -> bool:
    """Whether the kernel serves this cache and head count here."""
    if not (k_cache.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.is_contiguous()
            and available()):
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    fits = _kernel.function("pagoda_prefill_attention_fits", [_c.c_int] * 4, _c.c_int)
    return bool(fits(num_q_heads, num_kv_heads, head_dim, block_size))


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor,
            num_tokens: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, scale: float,
            out: torch.Tensor, isa: int | None = None) -> None:
    """For each sequence i: out rows starts[i] .. starts[i] + num_tokens[i] = causal attention of
    q's same rows, query t at position lens[i] - num_tokens[i] + t, over block table tables[i]
    (int32 [seqs, blocks], covering lens[i] positions); other rows of out are left alone. q and
    out [tokens, Hq, D] (q's rows may be a slice of wider ones, as the fused qkv projection's;
    fp32 or bf16: another dtype goes through an fp32 copy); the caches
    [num_blocks, bs, Hkv, D] as allocated (K in key_blocks' layout). Call only where
    runs_on(k_cache, Hq)."""
    num_seqs = starts.numel()
    if num_seqs == 0:
        return
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # rows of any stride; heads must be dense
        q = q.contiguous()
    if q.dtype not in DTYPES or out.dtype != q.dtype or not out.is_contiguous():
        target = torch.empty(q.shape, dtype=torch.float32)
        prefill(q.float(), k_cache, v_cache, starts, num_tokens, lens, tables, scale, target, isa)
        rows = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, num_tokens)])
        out.index_copy_(0, rows, target.index_select(0, rows).to(out.dtype))
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    starts, num_tokens, lens = (t.to(torch.int32).contiguous() for t in (starts, num_tokens, lens))
    tables = tables.to(torch.int32).contiguous()
    _kernel.fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
               DTYPES[k_cache.dtype], DTYPES[q.dtype], starts.data_ptr(), num_tokens.data_ptr(), lens.data_ptr(), tables.data_ptr(),
               tables.shape[1], num_seqs, q.shape[1], num_kv_heads, head_dim, block_size, scale,
               torch.get_num_threads(), isa or _kernel.best)


def agrees_with_reference() -> bool:
    """The best path against kernels/reference.py's float64 attention on a small random step
    (two sequences, one with cached context, GQA, a partial last block; the start-up check), in
    fp32 and in bf16 (where the AMX tiles take it: head dims of 32)."""
    from pagoda.kernels import reference
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 32, 16
    lens, new = torch.tensor([21, 40]), torch.tensor([21, 19])
    keys, values = (torch.randn(8, bs, hkv, d, generator=g) for _ in range(2))
    tables = torch.tensor([[5, 1, 0], [2, 7, 3]], dtype=torch.int32)
    queries = torch.randn(int(new.sum()), hq, d, generator=g)
    starts = torch.cumsum(new, 0) - new
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v_cache = (t.to(dtype) for t in (queries, keys, values))
        k_cache = torch.empty_like(k)
        key_blocks(k_cache).copy_(k.permute(0, 2, 3, 1))
        out = torch.empty_like(q)
        prefill(q, k_cache, v_cache, starts, new, lens, tables, d ** -0.5, out)
        want = reference.paged_attention_float64(q.float(), k.float(), v_cache.float(), tables, lens,
                                                 torch.cat([starts, new.sum()[None]]), d ** -0.5)
        if not bool(((out.double() - want).abs() <= tol).all()):
            return False
    return True


_kernel.check = agrees_with_reference
