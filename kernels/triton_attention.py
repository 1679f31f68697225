"""Triton paged attention and KV-cache write: the GPU twins of kernels/reference.py.

Shapes are those of kernels/reference.py. The attention kernels live in kernels/triton_paged.py
(design notes there); this module holds the KV write kernel and the host side: tile choice,
split-KV heuristic and launches.

Nothing here reads a device tensor when the hints `max_seq_len` and `max_query_len` are given,
so a call can be captured in a CUDA graph. The hints only steer tiling and the number of
split-KV segments: any value gives a correct result, good values give a fast one. When they
are missing they are computed from the tensors, which synchronises with the device.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_paged import paged_attention_kernel, reduce_segments_kernel

LOG2E = 1.4426950408889634
MAX_SEGMENTS = 64            # split-KV segments per query tile, at most
MIN_TILES_PER_SEGMENT = 2    # a segment gets at least this many BLOCK_N key tiles
CTAS_PER_SM = 4              # split until the grid has this many programs per SM
INTERPRETER_SMS = 4          # what the split heuristic assumes without a GPU


# ---------------------------------------------------------------------------------------------
# KV write


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
                     s_key_t, s_key_h, s_key_d, s_val_t, s_val_h, s_val_d,
                     s_kc_b, s_kc_s, s_kc_h, s_kc_d, s_vc_b, s_vc_s, s_vc_h, s_vc_d,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_tokens, cdiv(num_kv_heads, BLOCK_H)): copies BLOCK_H heads of one token."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:                                            # padding token: nothing to write
        return
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    h, d = offs_h[:, None], offs_d[None, :]
    k = tl.load(key_ptr + tok * s_key_t + h * s_key_h + d * s_key_d, mask=mask)
    v = tl.load(value_ptr + tok * s_val_t + h * s_val_h + d * s_val_d, mask=mask)
    tl.store(k_cache_ptr + block * s_kc_b + in_block * s_kc_s + h * s_kc_h + d * s_kc_d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * s_vc_b + in_block * s_vc_s + h * s_vc_h + d * s_vc_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] into their slots (-1: skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} disagree")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold "
                         f"{num_kv_heads} heads of {head_dim}")
    if num_tokens == 0:
        return
    for kernel, grid, args, constexprs, options in write_kv_launches(key, value, k_cache, v_cache,
                                                                     slot_mapping):
        kernel[grid](*args, **constexprs, **options)


def write_kv_launches(key, value, k_cache, v_cache, slot_mapping) -> list[tuple]:
    """The launches of write_kv as (kernel, grid, args, constexprs, options)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    args = (key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
            *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride())
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h,
                      BLOCK_D=block_d)
    return [(_write_kv_kernel, grid, args, constexprs, dict(num_warps=4))]


# ---------------------------------------------------------------------------------------------
# Paged attention


class AttentionConfig(NamedTuple):
    block_m: int        # query rows per tile: (token, head of the kv group) pairs
    block_q: int        # query tokens per tile = block_m // group
    block_n: int        # keys per inner step
    num_segments: int   # split-KV segments (1 = no split, no reduce kernel)
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                        num_sms: int) -> int:
    """Split-KV segments for a decode batch: enough programs to fill the GPU, no tiny segments.

    Without a split the grid has about num_seqs * num_kv_heads working programs; few sequences
    over long contexts leave most SMs idle, so the keys are divided into a power-of-two number
    of segments until there are CTAS_PER_SM programs per SM, each with at least
    MIN_TILES_PER_SEGMENT tiles of the longest context, and at most MAX_SEGMENTS segments.
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = CTAS_PER_SM * num_sms
    if programs >= target:
        return 1
    by_length = triton.cdiv(max(1, max_seq_len), block_n) // MIN_TILES_PER_SEGMENT
    if by_length < 2:
        return 1
    wanted = triton.next_power_of_2(triton.cdiv(target, programs))
    by_length = 1 << (by_length.bit_length() - 1)                   # largest power of two <=
    return min(wanted, MAX_SEGMENTS, by_length)


def choose_config(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  num_seqs: int, max_seq_len: int, max_query_len: int, num_sms: int,
                  num_kv_splits: int | None = None) -> AttentionConfig:
    """Tile sizes from shapes and host-side hints only (never from device data)."""
    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    small_m = max(16, triton.next_power_of_2(group))
    decode = max_query_len <= small_m // group       # decodes, or a few speculative tokens
    block_n = 64 if head_dim_pad * dtype.itemsize <= 256 else 32
    if decode:
        # One narrow tile per sequence: memory bound (long contexts get split below).
        block_m, num_warps, num_stages = small_m, 4, 3
    else:
        # Prefill chunks: wide tiles, compute bound.
        block_m = max(128 if head_dim_pad <= 128 else 64, triton.next_power_of_2(group))
        num_warps, num_stages = 8, 2
    if dtype == torch.float32:
        # float32 multiplies on the CUDA cores (exact "ieee" dot), which needs many registers:
        # narrow tiles keep it out of local memory. It is the checking dtype, not the fast one.
        block_m, block_n, num_warps, num_stages = small_m, 16, 4, 3
    segments = 1
    if decode:
        segments = choose_num_segments(num_seqs, num_kv_heads, max_seq_len, block_n, num_sms)
    if num_kv_splits is not None:
        segments = num_kv_splits
    if segments < 1 or segments & (segments - 1):
        raise ValueError(f"num_kv_splits must be a power of two, not {segments}")
    return AttentionConfig(block_m, block_m // group, block_n, segments, num_warps, num_stages)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_seq_len: int | None = None, max_query_len: int | None = None,
                    out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    config: AttentionConfig | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    max_seq_len, max_query_len: host-side upper bounds of seq_lens and of the query lengths
    (pass both to avoid a device sync). out: optional output of q's shape, returned.
    num_kv_splits: force the number of split-KV segments (a power of two); config: force every
    tile parameter (tests, benchmarks). Rows of q past query_start_loc[-1] are not written.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)} disagree")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries, block_tables num_seqs rows")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if config is None:
        if max_seq_len is None or max_query_len is None:
            # Fallback: one device sync. Callers that capture CUDA graphs pass both hints.
            query_lens = query_start_loc[1:] - query_start_loc[:-1]
            found = torch.stack([seq_lens.max().long(), query_lens.max().long()]).tolist()
            max_seq_len = found[0] if max_seq_len is None else max_seq_len
            max_query_len = found[1] if max_query_len is None else max_query_len
        config = choose_config(num_q_heads, num_kv_heads, head_dim, q.dtype, num_seqs,
                               max_seq_len, max_query_len, _num_sms(q.device), num_kv_splits)
    for kernel, grid, args, constexprs, options in paged_attention_launches(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, config):
        kernel[grid](*args, **constexprs, **options)
    return out


def paged_attention_launches(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             out, config: AttentionConfig) -> list[tuple]:
    """The launches of paged_attention as (kernel, grid, args, constexprs, options).

    Allocates the split-KV buffers and reads no device data (so it also works on meta tensors).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    segments = config.num_segments
    if segments > 1:
        seg_acc = torch.empty((num_tokens, num_q_heads, segments, head_dim_pad),
                              dtype=torch.float32, device=q.device)
        seg_max = torch.empty((num_tokens, num_q_heads, segments), dtype=torch.float32,
                              device=q.device)
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_acc = seg_max = seg_sum = out                   # never touched
    num_q_tiles = num_tokens // config.block_q + num_seqs
    launches = [(paged_attention_kernel, (num_q_tiles * num_kv_heads, segments),
                 (out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                  seg_acc, seg_max, seg_sum, scale * LOG2E, num_seqs, num_q_heads,
                  *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
                  block_tables.stride(0)),
                 dict(NUM_KV_HEADS=num_kv_heads, GROUP=num_q_heads // num_kv_heads,
                      HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=k_cache.shape[1],
                      BLOCK_M=config.block_m, BLOCK_Q=config.block_q, BLOCK_N=config.block_n,
                      NUM_SEGMENTS=segments,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32"),
                 dict(num_warps=config.num_warps, num_stages=config.num_stages))]
    if segments > 1:
        launches.append((reduce_segments_kernel, (num_tokens, num_q_heads),
                         (out, seg_acc, seg_max, seg_sum, query_start_loc, num_seqs, num_q_heads,
                          *out.stride()),
                         dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                              NUM_SEGMENTS=segments),
                         dict(num_warps=4)))
    return launches
