"""Paged attention on the CPU that reads K/V where they lie in the cache, in a few torch ops.

The padded reference (kernels/reference.py) copies every sequence's whole context out of the
block table in every layer, then runs SDPA over the copy: on a CPU that copy, not the
arithmetic, is most of the time. Here a decode never copies the cache:

- Scores are one `embedding_bag` over the K cache. In this backend a K block holds its keys
  transposed, [num_kv_heads, head_dim, block_size], so the cache is a table of block_size-long
  rows, one per (block, kv head, dim), and the scores of one query head over one block are the
  weighted sum of that block's head_dim rows with the query's components as weights: exactly
  what embedding_bag computes (FBGEMM's gather-multiply-accumulate kernel, no copy).
- Softmax runs over a padded [seqs, q heads, max_context] tensor: it has no head_dim, so it is
  small.
- The output is one `embedding_bag` over the V cache (blocks [block_size, num_kv_heads,
  head_dim], as everywhere): a table of head_dim-long rows per (slot, kv head), one bag per
  (sequence, q head) over its positions, weighted by the probabilities.

All the indices depend only on the step's metadata: `plan_attention` builds them once per step
and every layer reuses them. Positions past a sequence's length are never read through the V
table, and their scores are overwritten with -inf, so stale NaN or Inf in the cache cannot leak.
A sequence with several new tokens (a prefill or a prefill chunk) is worth its own SDPA call:
its keys are gathered from its blocks, which costs little next to its q_len x seq_len products.

Shapes as in kernels/reference.py, except the layout of the K blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def key_blocks(k_cache: torch.Tensor) -> torch.Tensor:
    """The K cache [num_blocks, block_size, num_kv_heads, head_dim] as this backend lays it out:
    [num_blocks, num_kv_heads, head_dim, block_size]. Block copies and swaps move whole blocks,
    so they need not know."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return k_cache.view(num_blocks, num_kv_heads, head_dim, block_size)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    if bool((slot_mapping < 0).any()):  # tokens to skip; a worker's steps have none
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_blocks(k_cache)[blocks, :, :, offsets] = key.to(k_cache.dtype)


@dataclass
class DecodePlan:
    """Indices for the sequences with exactly one new token (Sd of them; Hq query heads)."""
    rows: torch.Tensor          # [Sd]: their token's row in q and out
    max_blocks: int
    k_rows: torch.Tensor        # [bags, head_dim]: K table rows of each (seq, head, block) bag
    q_rows: torch.Tensor        # [bags]: row of q.view(Sd * Hq, head_dim) weighting each bag
    score_rows: torch.Tensor    # [bags]: row of scores.view(Sd * Hq * max_blocks, block_size)
    stale: torch.Tensor         # where scores.view(-1) sits past seq_len in a sequence's last block
    v_rows: torch.Tensor        # [Hq * sum(seq_lens)]: V table rows, bags of (seq, head)
    v_offsets: torch.Tensor     # [Sd * Hq]: where each (seq, head) bag starts in v_rows
    prob_index: torch.Tensor    # [Hq * sum(seq_lens)]: the probability weighting each V row


@dataclass
class PrefillPlan:
    start: int                  # first row in q and out
    num_tokens: int
    seq_len: int
    blocks: torch.Tensor        # int64 [ceil(seq_len / block_size)]
    mask: torch.Tensor | None   # bool [num_tokens, seq_len], None when nothing is cached (causal)


@dataclass
class AttentionPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, k_cache: torch.Tensor,
                   num_q_heads: int) -> AttentionPlan:
    """Everything paged_attention needs besides q and the cache; it depends only on the step."""
    qsl = query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens.long()
    block_size, device = k_cache.shape[1], k_cache.device
    prefills = []
    for s in (query_lens > 1).nonzero().flatten().tolist():
        n, seq_len = int(query_lens[s]), int(seq_lens[s])
        blocks = block_tables[s, :-(-seq_len // block_size)].long()
        # Query i sits at position seq_len - n + i and sees the keys up to there.
        positions = torch.arange(seq_len, device=device)
        mask = None if n == seq_len else positions[None, :] <= positions[seq_len - n:, None]
        prefills.append(PrefillPlan(int(qsl[s]), n, seq_len, blocks, mask))
    decode = (query_lens == 1).nonzero().flatten()
    if decode.numel() == 0:
        return AttentionPlan(None, prefills)
    return AttentionPlan(_plan_decode(qsl[:-1][decode], seq_lens[decode],
                                      block_tables[decode].long(), k_cache, num_q_heads), prefills)


def _plan_decode(rows, lens, tables, k_cache, num_q_heads) -> DecodePlan:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = lens.device
    # Indices into the K and V tables; int32 halves what every layer reads when it fits.
    index_dtype = torch.int32 if k_cache.numel() < 2**31 else torch.int64
    num_seqs = lens.numel()
    max_blocks = -(-int(lens.max()) // block_size)
    width = max_blocks * block_size
    tables = tables[:, :max_blocks]
    kv_head = (torch.arange(num_q_heads, device=device) // (num_q_heads // num_kv_heads))[:, None]
    # Every index below is first laid out padded, [Sd, Hq, blocks or positions], then the entries
    # in use are picked in row-major order: bags in (sequence, q head, block) order make each
    # (sequence, head) row of scores contiguous, and the group heads that share a kv head read
    # the same K rows back to back.
    block_used = torch.arange(max_blocks, device=device) * block_size < lens[:, None]
    bag_used = block_used[:, None, :].expand(num_seqs, num_q_heads, max_blocks)
    first_row = ((tables[:, None, :] * num_kv_heads + kv_head) * head_dim).to(index_dtype)
    dims = torch.arange(head_dim, device=device, dtype=index_dtype)
    k_rows = first_row[bag_used][:, None] + dims
    score_rows = bag_used.flatten().nonzero().flatten()

    position_used = torch.arange(width, device=device) < lens[:, None]
    stale = (~position_used & block_used.repeat_interleave(block_size, 1)).nonzero()
    heads = torch.arange(num_q_heads, device=device)
    stale = ((stale[:, :1] * num_q_heads + heads) * width + stale[:, 1:]).flatten()
    prob_index = position_used[:, None, :].expand(num_seqs, num_q_heads, width).flatten()
    prob_index = prob_index.nonzero().flatten()
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    v_rows = (slots[:, None, :] * num_kv_heads + kv_head).to(index_dtype).flatten()[prob_index]
    bag_sizes = lens.repeat_interleave(num_q_heads)
    return DecodePlan(
        rows=rows, max_blocks=max_blocks, k_rows=k_rows, q_rows=score_rows // max_blocks,
        score_rows=score_rows, stale=stale, v_rows=v_rows,
        v_offsets=(torch.cumsum(bag_sizes, 0) - bag_sizes).to(index_dtype), prob_index=prob_index)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: AttentionPlan, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (K blocks
    in key_blocks' layout). Rows of q that belong to no sequence are left as they are in out."""
    if out is None:
        out = torch.zeros_like(q)
    if plan.decode is not None:
        _decode(q, k_cache, v_cache, plan.decode, scale, out)
    for prefill in plan.prefills:
        _prefill(q, k_cache, v_cache, prefill, scale, out)
    return out


def _decode(q, k_cache, v_cache, plan: DecodePlan, scale, out) -> None:
    num_seqs = plan.rows.numel()
    num_q_heads, head_dim = q.shape[1:]
    block_size = k_cache.shape[1]
    queries = (q.index_select(0, plan.rows) * scale).to(k_cache.dtype).view(-1, head_dim)
    block_scores = F.embedding_bag(plan.k_rows, k_cache.view(-1, block_size), mode="sum",
                                   per_sample_weights=queries.index_select(0, plan.q_rows))
    scores = block_scores.new_full((num_seqs * num_q_heads * plan.max_blocks, block_size),
                                   float("-inf"))
    scores.index_copy_(0, plan.score_rows, block_scores)
    scores = scores.view(-1).index_fill_(0, plan.stale, float("-inf"))  # NaN there is no key
    probs = torch.softmax(scores.view(num_seqs * num_q_heads, -1), -1, dtype=torch.float32)
    weights = probs.view(-1).index_select(0, plan.prob_index).to(v_cache.dtype)
    rows = F.embedding_bag(plan.v_rows, v_cache.view(-1, head_dim), plan.v_offsets, mode="sum",
                           per_sample_weights=weights)
    out.index_copy_(0, plan.rows, rows.view(num_seqs, num_q_heads, head_dim).to(out.dtype))


def _prefill(q, k_cache, v_cache, plan: PrefillPlan, scale, out) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    keys = key_blocks(k_cache).index_select(0, plan.blocks)          # [nb, Hkv, D, block]
    keys = keys.permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_dim)[:, :plan.seq_len]
    values = v_cache.index_select(0, plan.blocks).view(-1, num_kv_heads, head_dim)
    values = values[:plan.seq_len].transpose(0, 1)
    rows = slice(plan.start, plan.start + plan.num_tokens)
    # With a batch dimension: torch runs 4-D inputs through its flash kernel for the CPU, 3-D ones
    # through the unfused math path (3-4x slower at a few hundred tokens).
    attn = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1)[None], keys.to(q.dtype)[None], values.to(q.dtype)[None],
        attn_mask=plan.mask, is_causal=plan.mask is None, scale=scale, enable_gqa=True)
    out[rows] = attn[0].transpose(0, 1).to(out.dtype)
