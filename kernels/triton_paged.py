"""Triton kernels of the paged attention (the launch code is in kernels/triton_attention.py).

One kernel, `paged_attention_kernel`, serves decodes, prefills and prefill chunks over a cached
prefix in the same batch. Its grid is (query tiles x kv heads, segments):

- A query tile holds BLOCK_M rows; row r is (query token r // GROUP, query head r % GROUP of the
  program's kv head), so the GROUP query heads that share a kv head share each K/V load and a
  decode step is still a BLOCK_M x BLOCK_N `tl.dot`. A tile covers BLOCK_Q = BLOCK_M // GROUP
  tokens of one sequence.
- Sequence i owns tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1); that is an upper
  bound of what it needs, so the grid (num_tokens // BLOCK_Q + num_seqs tiles) depends on shapes
  only.
  A program finds its sequence with a binary search over query_start_loc and leaves at once when
  its tile is past the sequence's queries.
- The kv loop visits positions [0, last query position of the tile] in tiles of BLOCK_N keys,
  looking up the physical block of every key (so BLOCK_N and the cache block size are
  independent). Tiles entirely below the tile's first query position need no causal mask and no
  bounds checks; the rest (at most a few) are masked.
- With NUM_SEGMENTS > 1 (split-KV) the kv tiles of a query tile are divided into NUM_SEGMENTS
  contiguous ranges, one program each; every program writes its unnormalised accumulator, its
  running max and its sum of exponentials, and `reduce_segments_kernel` merges them.

Softmax runs online in float32 in base 2 (the scale is multiplied by log2(e)). Every offset into
q, out and the caches is computed in int64.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query tile is <= tile (binary search over query_start_loc)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_2d(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pos, kv_tile, kv_end, k_base, v_base, bt_row,
                 s_k_b, s_k_s, s_k_d, s_v_b, s_v_s, s_v_d, qk_scale, offs_n, offs_d, d_ok,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys [kv_tile * BLOCK_N, (kv_tile + 1) * BLOCK_N)."""
    k_pos = kv_tile * BLOCK_N + offs_n
    n_ok = k_pos < kv_end
    if MASKED:
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    in_block = (k_pos % BLOCK_SIZE).to(tl.int64)
    d64 = offs_d.to(tl.int64)
    k_ptrs = k_base + (block * s_k_b + in_block * s_k_s)[None, :] + (d64 * s_k_d)[:, None]
    k = _load_2d(k_ptrs, d_ok, n_ok, PAD_D, MASKED)                    # [HEAD_DIM_PAD, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + (block * s_v_b + in_block * s_v_s)[:, None] + (d64 * s_v_d)[None, :]
    v = _load_2d(v_ptrs, n_ok, d_ok, MASKED, PAD_D)                    # [BLOCK_N, HEAD_DIM_PAD]
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# num_seqs changes every step: without do_not_specialize, Triton would compile separate variants
# for num_seqs == 1 and for multiples of 16.
@triton.jit(do_not_specialize=["num_seqs"])
def paged_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        seg_acc_ptr, seg_max_ptr, seg_sum_ptr,
        qk_scale, num_seqs, num_q_heads,
        s_q_t, s_q_h, s_q_d, s_o_t, s_o_h, s_o_d,
        s_k_b, s_k_s, s_k_h, s_k_d, s_v_b, s_v_s, s_v_h, s_v_d, s_bt,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    # Axis 0 enumerates (query tile, kv head) with the kv heads of a tile adjacent (they read the
    # same cache blocks) and the last tiles first (under the causal mask they are the longest).
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    tile = tl.num_programs(0) // NUM_KV_HEADS - 1 - pid // NUM_KV_HEADS
    seg = tl.program_id(1)

    seq = _find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len          # cached tokens before the new ones

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    d_ok = offs_d < HEAD_DIM
    row_tok = local * BLOCK_Q + offs_m // GROUP             # token index among the new tokens
    row_ok = (offs_m < BLOCK_Q * GROUP) & (row_tok < q_len)
    q_pos = ctx_len + row_tok                               # absolute position of the row's token
    tok64 = (q_start + row_tok).to(tl.int64)
    head64 = (kv_head * GROUP + offs_m % GROUP).to(tl.int64)
    d64 = offs_d.to(tl.int64)
    row_d_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok64[:, None] * s_q_t + head64[:, None] * s_q_h + d64[None, :] * s_q_d,
                mask=row_d_ok, other=0.0)

    first_pos = ctx_len + local * BLOCK_Q
    kv_end = ctx_len + tl.minimum((local + 1) * BLOCK_Q, q_len)  # keys [0, kv_end) are needed
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    num_full = (first_pos + 1) // BLOCK_N                   # tiles every row sees whole
    if NUM_SEGMENTS == 1:
        t_lo = 0
        t_hi = num_tiles
    else:
        per_seg = tl.cdiv(num_tiles, NUM_SEGMENTS)
        t_lo = seg * per_seg
        t_hi = tl.minimum(t_lo + per_seg, num_tiles)

    k_base = k_ptr + kv_head.to(tl.int64) * s_k_h
    v_base = v_ptr + kv_head.to(tl.int64) * s_v_h
    bt_row = bt_ptr + seq.to(tl.int64) * s_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for t in range(t_lo, tl.minimum(t_hi, num_full)):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, t, kv_end, k_base, v_base, bt_row,
                                     s_k_b, s_k_s, s_k_d, s_v_b, s_v_s, s_v_d, qk_scale,
                                     offs_n, offs_d, d_ok, BLOCK_SIZE, BLOCK_N, PAD_D, False,
                                     DOT_PRECISION)
    for t in range(tl.maximum(t_lo, num_full), t_hi):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, t, kv_end, k_base, v_base, bt_row,
                                     s_k_b, s_k_s, s_k_d, s_v_b, s_v_s, s_v_d, qk_scale,
                                     offs_n, offs_d, d_ok, BLOCK_SIZE, BLOCK_N, PAD_D, True,
                                     DOT_PRECISION)

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok64[:, None] * s_o_t + head64[:, None] * s_o_h + d64[None, :] * s_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=row_d_ok)
    else:
        # Segment buffers: acc [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM_PAD], max/sum
        # [num_tokens, num_q_heads, NUM_SEGMENTS], all float32 and contiguous.
        seg_row = (tok64 * num_q_heads + head64) * NUM_SEGMENTS + seg
        tl.store(seg_acc_ptr + seg_row[:, None] * HEAD_DIM_PAD + d64[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(seg_max_ptr + seg_row, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + seg_row, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs"])
def reduce_segments_kernel(out_ptr, seg_acc_ptr, seg_max_ptr, seg_sum_ptr, qsl_ptr, num_seqs,
                           num_q_heads, s_o_t, s_o_h, s_o_d,
                           HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           NUM_SEGMENTS: tl.constexpr):
    """Merges the segments of one (token, query head): grid (num_tokens, num_q_heads)."""
    tok = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if tok >= tl.load(qsl_ptr + num_seqs):                 # padding past the last sequence
        return
    row = (tok.to(tl.int64) * num_q_heads + head) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(seg_max_ptr + row + offs_s)
    l = tl.load(seg_sum_ptr + row + offs_s)
    m_max = tl.max(m, 0)                                    # finite: segment 0 always sees key 0
    w = tl.exp2(m - m_max)                                  # empty segments (m = -inf) weigh 0
    acc = tl.load(seg_acc_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    d64 = offs_d.to(tl.int64)
    tl.store(out_ptr + tok.to(tl.int64) * s_o_t + head * s_o_h + d64 * s_o_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
