"""Plain torch twins of the Triton kernels: the definition of what they compute, which the tests
hold kernels/triton_attention.py and kernels/cpu_attention.py to.

Shapes, shared with the Triton versions in kernels/triton_attention.py:
  key, value     [num_tokens, num_kv_heads, head_dim]
  k/v cache      [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping   int64 [num_tokens], slot = block * block_size + offset, -1 = skip
  q, out         [num_tokens, num_q_heads, head_dim], the new tokens of all sequences, flattened
  block_tables   int32 [num_seqs, max_blocks]
  seq_lens       int32 [num_seqs], whole context including the new tokens
  query_start_loc int32 [num_seqs + 1]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


@dataclass
class Layout:
    """Where each sequence's queries and keys sit in the padded batch."""
    num_seqs: int
    max_q: int
    max_ctx: int
    tables: torch.Tensor     # int64 [S, max_blocks]: padding entries point at block 0
    key_valid: torch.Tensor  # bool [S, max_ctx]
    q_valid: torch.Tensor    # bool [S, max_q]
    flat_idx: torch.Tensor   # int64 [S, max_q]: row of q for each padded query
    mask: torch.Tensor       # bool [S, max_q, max_ctx]: causal and in range


def prepare_layout(num_tokens: int, block_size: int, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   max_seq_len: int | None = None, max_query_len: int | None = None) -> Layout:
    device = block_tables.device
    num_seqs = seq_lens.shape[0]
    starts = query_start_loc[:-1].long()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_lens = seq_lens.long()
    max_q = int(max_query_len if max_query_len is not None else query_lens.max())
    max_len = int(max_seq_len if max_seq_len is not None else seq_lens.max())
    max_blocks_used = (max_len + block_size - 1) // block_size
    max_ctx = max_blocks_used * block_size
    k_pos = torch.arange(max_ctx, device=device)
    key_valid = k_pos[None, :] < seq_lens[:, None]
    # Table entries past a sequence's last block are padding: never index through them.
    tables = torch.where(key_valid[:, ::block_size], block_tables[:, :max_blocks_used].long(), 0)
    q_idx = torch.arange(max_q, device=device)
    q_valid = q_idx[None, :] < query_lens[:, None]
    flat_idx = (starts[:, None] + q_idx[None, :]).clamp(max=max(num_tokens - 1, 0))
    # Query i of a sequence sits at absolute position seq_len - query_len + i.
    q_pos = seq_lens[:, None] - query_lens[:, None] + q_idx[None, :]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :] & q_valid[:, :, None]
    # Padded query rows see key 0 only, to keep softmax finite; their output is dropped.
    mask[:, :, 0] |= ~q_valid
    return Layout(num_seqs, max_q, max_ctx, tables, key_valid, q_valid, flat_idx, mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    max_seq_len: int | None = None, max_query_len: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    The batch is padded to [num_seqs, max_query_len] queries and [num_seqs, max_context] keys so
    that one SDPA call serves every sequence; the mask hides padding and future tokens. The
    hints, when given, spare a device-to-host read (the Triton twin takes the same ones).
    Rows of q past query_start_loc[-1] (padding) are left as they are in `out`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.zeros_like(q)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    layout = prepare_layout(num_tokens, block_size, block_tables, seq_lens, query_start_loc,
                            max_seq_len, max_query_len)
    num_seqs, max_q, max_ctx = layout.num_seqs, layout.max_q, layout.max_ctx

    # Gather every sequence's context: [num_seqs, max_ctx, num_kv_heads, head_dim]. Masked
    # scores become -inf whatever the key holds, but 0 * NaN is NaN: values past seq_len are
    # zeroed, so that stale NaN or Inf there cannot leak into the output.
    keys = k_cache[layout.tables].reshape(num_seqs, max_ctx, num_kv_heads, head_dim)
    values = v_cache[layout.tables].reshape(num_seqs, max_ctx, num_kv_heads, head_dim)
    values.masked_fill_(~layout.key_valid[:, :, None, None], 0)
    queries = q[layout.flat_idx]  # [num_seqs, max_q, Hq, D]

    # GQA without copying K/V per query head: the `group` query heads that share a KV head are
    # stacked as extra query rows, (query, head-in-group) pairs, as the Triton kernel does.
    group = num_q_heads // num_kv_heads
    qh = queries.reshape(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qh = qh.reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
    kh = keys.to(q.dtype).transpose(1, 2)                            # [S, Hkv, max_ctx, D]
    vh = values.to(q.dtype).transpose(1, 2)
    row_mask = layout.mask[:, :, None, :].expand(num_seqs, max_q, group, max_ctx)
    row_mask = row_mask.reshape(num_seqs, 1, max_q * group, max_ctx)
    attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=row_mask, scale=scale)
    attn = attn.reshape(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    rows = attn.reshape(num_seqs, max_q, num_q_heads, head_dim)[layout.q_valid]
    out[:rows.shape[0]] = rows.to(out.dtype)
    return out


def paged_attention_float64(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            scale) -> torch.Tensor:
    """A slow per-sequence loop in float64: the independent check for both implementations."""
    out = torch.empty(q.shape, dtype=torch.float64)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(seq_lens[s])
        blocks = [int(b) for b in block_tables[s, :(ctx + block_size - 1) // block_size]]
        k = torch.cat([k_cache[b] for b in blocks])[:ctx].double()
        v = torch.cat([v_cache[b] for b in blocks])[:ctx].double()
        for t in range(start, end):
            pos = ctx - (end - start) + (t - start)
            for h in range(q.shape[1]):
                kh = k[:pos + 1, h // group]
                scores = (kh @ q[t, h].double()) * scale
                out[t, h] = torch.softmax(scores, 0) @ v[:pos + 1, h // group]
    return out


def matmul_within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float) -> bool:
    """Whether got equals x @ w^T (w as its float64 values) within rtol of the sum of |x||w| per
    entry: the start-up checks of the CPU matmul kernels (fp32, bf16, int8, GGUF)."""
    return matmul_error(got, x, w, rtol) <= 1


def matmul_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float) -> float:
    """got's largest distance from x @ w^T in float64 over matmul_within's bound (<= 1: within
    it; NaN where got holds a NaN)."""
    x, w = x.double(), w.double()
    return _worst((got.double() - x @ w.t()).abs() / (rtol * (x.abs() @ w.abs().t()) + 1e-6))


def bf16_matmul_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """A bf16 product's (kernels/csrc/cpu_gemm_bf16.c) largest distance from x @ w^T in float64 over
    its bound: one rounding to bf16 (2^-8 relative, half an ulp is 2^-9) over an fp32 sum of
    exact products (error ~ sqrt(K) 2^-24 sum |x||w|)."""
    x, w = x.double(), w.double()
    want = x @ w.t()
    tol = 2.0 ** -8 * want.abs() + 1e-6 * (x.shape[1] ** 0.5 + 1) * (x.abs() @ w.abs().t()) + 1e-30
    return _worst((got.double() - want).abs() / tol)


def _worst(ratios: torch.Tensor) -> float:
    return float(ratios.max()) if ratios.numel() else 0.0


def xwt_agrees(xwt, dtype: torch.dtype, rtol: float) -> bool:
    """xwt(x, w) against float64 on a small random product of `dtype` operands (the start-up
    check of the fp32 and bf16 kernels)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 200, generator=g).to(dtype), torch.randn(37, 200, generator=g).to(dtype)
    return matmul_within(xwt(x, w), x, w, rtol)


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight in float64 (the pointwise kernels' reference)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rotary_float64(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each pair (2i, 2i + 1) turned by cis [T, 1, D/2] (cos + i sin), in float64."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * cis.to(torch.complex128)).flatten(-2)


def silu_mul_float64(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def within_bf16(got: torch.Tensor, want: torch.Tensor, roundings: int = 3) -> bool:
    """Whether got (bf16) equals the float64 want within `roundings` bf16 roundings (2^-9 of
    the value each) and 2^-9 of the largest value (the sums that cancel to near zero)."""
    want = want.double()
    tol = roundings * 2.0 ** -9 * want.abs() + 2.0 ** -9 * want.abs().max()
    return bool(((got.double() - want).abs() <= tol).all())
