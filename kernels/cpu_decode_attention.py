"""Paged decode attention in C (kernels/csrc/cpu_decode_attention.c): every decode row's attention
over its block table in one call a layer, reading the cache where it lies (K blocks in
kernels/cpu_attention.py's transposed layout), fp32 or bf16. kernels/cpu_attention.py takes it
for its decode rows where it runs; its torch path stays for the other dtypes and CPUs.

The instruction set is chosen at run time: AVX-512F, else AVX2 + FMA, else none (available() is
False). One library holds both paths.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagoda.kernels import cbuild
from pagoda.kernels.cpu_kv_layout import key_blocks

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_decode_attention.c"
FLAGS = cbuild.EXP_KERNEL_FLAGS
ISA_NAMES = {2: "AVX-512F", 1: "AVX2+FMA"}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_c = ctypes
_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_decode_attention_isa", "pagoda_decode_attention",
    [_c.c_void_p, _c.c_int64, _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_void_p, _c.c_void_p, _c.c_void_p,
     _c.c_int64, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_float, _c.c_void_p, _c.c_int64,
     _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int, _c.c_int],
    ISA_NAMES, "attending with torch ops")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas

# Whether the kernel requests the blocks ahead of the one it reads (its own prefetch) or leaves
# them to the hardware: the machine's (worker/startup/measurements.py measures it at start-up and
# sets this; the one-C-call decode step reads it too).
prefetch = True


def runs_on(k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves a cache of this dtype and device here."""
    return k_cache.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.is_contiguous() \
        and available()


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
           lens: torch.Tensor, tables: torch.Tensor, scale: float, out: torch.Tensor,
           isa: int | None = None, grouping: int = -1, ahead: bool | None = None) -> None:
    """out[rows[i]] = attention of q[rows[i]] over the first lens[i] positions of block table
    tables[i] (int32 [rows, blocks]), for every head; other rows of out are left alone. q and
    out [tokens, Hq, D]; the caches [num_blocks, bs, Hkv, D] as allocated (K in key_blocks'
    layout). grouping: the query heads of a kv head attended together (1), one by one (0), or as
    the kernel decides for the step's size (-1; both ways give the same sums, in another order).
    ahead: the kernel's prefetch on or off (default: the module's `prefetch`). Call only where
    runs_on(k_cache)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    num_rows = rows.numel()
    if num_rows == 0:
        return
    rows32, lens32 = rows.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous()
    tables = tables.to(torch.int32).contiguous()
    width = tables.shape[1] * block_size
    # bf16 q and out (a bf16 model's) are read and written where they lie: q is the rows of the
    # fused qkv projection (row stride its width); else fp32 copies.
    io = 1 if q.dtype == out.dtype == torch.bfloat16 and _rows_of_heads(q) and _rows_of_heads(out) else 0
    qf = q if io or (q.dtype == torch.float32 and q.is_contiguous()) else q.float().contiguous()
    target = out if io or (out.dtype == torch.float32 and out.is_contiguous()) else torch.empty_like(qf)
    _kernel.fn(qf.data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
               DTYPES[k_cache.dtype], rows32.data_ptr(), lens32.data_ptr(), tables.data_ptr(),
               tables.shape[1], num_rows, num_q_heads, num_kv_heads, head_dim, block_size, scale,
               target.data_ptr(), target.stride(0), width, torch.get_num_threads(),
               isa or _kernel.best, grouping, io, int(prefetch if ahead is None else ahead))
    if target is not out:
        out.index_copy_(0, rows, target.index_select(0, rows).to(out.dtype))


def _rows_of_heads(x: torch.Tensor) -> bool:
    """Whether x [tokens, heads, D] holds each token's heads side by side (any row stride)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels/cpu_attention.py write_kv in one C call: key and value [T, Hkv, D] into the caches
    at slot_mapping (negative: skipped). Call only where runs_on(k_cache)."""
    key = key.to(k_cache.dtype).contiguous()
    value = value.to(v_cache.dtype).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    write = _kernel.function("pagoda_write_kv", _WRITE_KV_ARGS)
    write(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.element_size(),
          slots.data_ptr(), key.shape[0], num_kv_heads, head_dim, block_size)


_WRITE_KV_ARGS = [_c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_int, _c.c_void_p, _c.c_int,
                  _c.c_int, _c.c_int, _c.c_int]


def agrees_with_reference() -> bool:
    """The best path against kernels/reference.py's float64 attention on a small random step
    (three sequences, GQA, a partial last block; the start-up check)."""
    from pagoda.kernels import reference
    g = torch.Generator().manual_seed(0)
    lens, hq, hkv, d, bs = torch.tensor([5, 17, 33]), 4, 2, 16, 8
    num_blocks = 12
    keys, v_cache = (torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2))
    k_cache = torch.empty_like(keys)
    key_blocks(k_cache).copy_(keys.permute(0, 2, 3, 1))
    tables = torch.tensor([[0, 0, 0, 0, 0], [1, 2, 3, 0, 0], [4, 5, 6, 7, 8]], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=g)
    out = torch.empty_like(q)
    decode(q, k_cache, v_cache, torch.arange(3), lens, tables, d ** -0.5, out)
    want = reference.paged_attention_float64(q, keys, v_cache, tables, lens, torch.arange(4), d ** -0.5)
    return bool(((out.double() - want).abs() <= 1e-5).all())


_kernel.check = agrees_with_reference
