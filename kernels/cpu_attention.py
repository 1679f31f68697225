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

Where kernels/csrc/cpu_decode_attention.c runs (an fp32 or bf16 cache on AVX2 or AVX-512), the decode
rows take it instead: one C call a layer over the block tables, none of the indices above.

All the indices depend only on the step's metadata: `plan_attention` builds them once per step
and every layer reuses them. Positions past a sequence's length are never read through the V
table, and their scores are overwritten with -inf, so stale NaN or Inf in the cache cannot leak.

A sequence with n > 1 new tokens (a speculative verification, a prefill chunk) takes one of:
- decode rows (n <= MAX_DECODE_ROWS): n decodes over the same block table, row i one of
  seq_len - n + i + 1 tokens, which makes it causal. Each row reads the context again, and the
  indices grow with n x context: it pays only for the smallest n.
- the short path (n <= MAX_SHORT_QUERY): the sequences' K and V are gathered, in groups of
  similar length under SHORT_GROUP_ELEMENTS, and each group is two batched matmuls (the heads
  of a kv head stacked as query rows) around one masked softmax: one set of ops per group, not
  per sequence, and the copy costs little next to the n x context products.
- SDPA, one call per sequence over its gathered context: torch's flash kernel, which never
  holds the n x context scores, is best for long chunks.
Where kernels/csrc/cpu_prefill_attention.c runs (an fp32 or bf16 cache, AVX2 or AVX-512), every
sequence past the decode rows takes it instead of the last two: one C call a layer, no copy.

Shapes as in kernels/reference.py, except the layout of the K blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_decode_attention, cpu_prefill_attention
from pagoda.kernels.cpu_kv_layout import key_blocks

# The path bounds, from `bench/bench_cpu_attention.py --paths` on the 2-core dev machine
# (SmolLM2's 9/3 heads, one thread, contexts 128-2048, batch 1 and 16, medians of 3 runs).
# Decode rows read the context once per row: fastest for n = 2 (up to 2.6x the short path at
# batch 16), mostly behind from 4, 1.4-10x slower from 8 on, with a plan that grows with n x
# context. At batch 16 and n <= 16 the short path beats the per-sequence SDPA by 1.5-3.6x in
# bf16 and is at par in fp32 (0.83-1.1x; up to 2x on 128-token contexts); at 32, fp32 SDPA is
# level or ahead and the short path's scores grow with n. 17 is a verification of k = 16.
MAX_DECODE_ROWS = 2
MAX_SHORT_QUERY = 17
# With kernels/csrc/cpu_decode_attention.c a decode row costs no indices and the rows win up to 4-8
# (the same benchmark, stop 33: at batch 16 and 512 tokens, 4 rows 2.4 ms against 6.5 for the
# short path and 4.6 for SDPA, 8 rows 4.3 against 8.8 and 6.3 in fp32; bf16 about even at 4): a
# verification of k = 4 proposals is 5 decode rows.
MAX_KERNEL_DECODE_ROWS = 5
# Elements of K and V one group of short sequences gathers (16 MiB in fp32): bounds the copy of
# a big batch; a group still holds five sequences of 2048 tokens (SmolLM2).
SHORT_GROUP_ELEMENTS = 1 << 22


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, kernel: bool | None = None) -> None:
    """The step's keys and values into the cache (negative slots skipped): in one C call where
    kernels/csrc/cpu_decode_attention.c runs (kernel None), else torch's index ops."""
    if kernel is None:
        kernel = cpu_decode_attention.runs_on(k_cache)
    if kernel:
        cpu_decode_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    block_size = k_cache.shape[1]
    if bool((slot_mapping < 0).any()):  # tokens to skip; a worker's steps have none
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_blocks(k_cache)[blocks, :, :, offsets] = key.to(k_cache.dtype)


@dataclass
class DecodePlan:
    """The decode rows (Sd of them; Hq query heads): n per sequence with n <= MAX_DECODE_ROWS
    (MAX_KERNEL_DECODE_ROWS with the C kernel) new tokens, row i seeing its first
    seq_len - n + i + 1 positions. The C kernel reads rows,
    lens and tables; the torch path the indices after them (None when the kernel runs)."""
    rows: torch.Tensor          # [Sd]: each one's token's row in q and out
    max_blocks: int
    lens: torch.Tensor          # [Sd]: positions each row sees
    tables: torch.Tensor        # int32 [Sd, max_blocks]: each row's block table
    k_rows: torch.Tensor | None = None      # [bags, head_dim]: K table rows of each (seq, head, block) bag
    q_rows: torch.Tensor | None = None      # [bags]: row of q.view(Sd * Hq, head_dim) weighting each bag
    score_rows: torch.Tensor | None = None  # [bags]: row of scores.view(Sd * Hq * max_blocks, block_size)
    stale: torch.Tensor | None = None       # where scores.view(-1) sits past seq_len in a sequence's last block
    v_rows: torch.Tensor | None = None      # [Hq * sum(seq_lens)]: V table rows, bags of (seq, head)
    v_offsets: torch.Tensor | None = None   # [Sd * Hq]: where each (seq, head) bag starts in v_rows
    prob_index: torch.Tensor | None = None  # [Hq * sum(seq_lens)]: the probability weighting each V row


@dataclass
class PrefillPlan:
    start: int                  # first row in q and out
    num_tokens: int
    seq_len: int
    blocks: torch.Tensor        # int64 [ceil(seq_len / block_size)]
    mask: torch.Tensor | None   # bool [num_tokens, seq_len], None when nothing is cached (causal)


@dataclass
class KernelPrefillPlan:
    """The sequences kernels/csrc/cpu_prefill_attention.c attends in one call: sequence i's
    num_tokens[i] queries are rows starts[i]... of q and out, the last of its lens[i] positions."""
    starts: torch.Tensor        # int32 [S]
    num_tokens: torch.Tensor    # int32 [S]
    lens: torch.Tensor          # int32 [S]
    tables: torch.Tensor        # int32 [S, blocks]: covering each one's lens[i] positions


@dataclass
class ShortPlan:
    """A group of S sequences with up to MAX_SHORT_QUERY new tokens, padded to M queries each
    and W = max_blocks * block_size keys (Hkv kv heads, G = Hq / Hkv)."""
    q_rows: torch.Tensor        # [S * M]: row of q for each query; padding repeats the last one
    used: torch.Tensor          # [tokens]: which of the S * M queries are real, in q's order
    out_rows: torch.Tensor      # [tokens]: their rows in out
    k_rows: torch.Tensor        # [S, Hkv, D, max_blocks]: K table rows, [S, Hkv, D, W] gathered
    v_rows: torch.Tensor        # [S, Hkv, W]: V table rows; past seq_len, position 0's
    tail: int                   # every query sees the keys before this one
    hidden: torch.Tensor        # bool [S, 1, 1, M, W - tail]: the keys from there each must not


@dataclass
class AttentionPlan:
    decode: DecodePlan | None
    prefills: list[PrefillPlan]
    shorts: list[ShortPlan] = field(default_factory=list)
    kernel: bool = False  # kernels/csrc/cpu_decode_attention.c serves this step's cache (decode, write_kv)
    kernel_prefill: KernelPrefillPlan | None = None  # instead of prefills, where the C kernel runs


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, k_cache: torch.Tensor, num_q_heads: int,
                   max_decode_rows: int | None = None,
                   max_short_query: int = MAX_SHORT_QUERY,
                   decode_kernel: bool | None = None,
                   prefill_kernel: bool | None = None) -> AttentionPlan:
    """Everything paged_attention needs besides q and the cache; it depends only on the step.
    A sequence with n new tokens takes the decode path if n <= max_decode_rows, else the C
    prefill kernel where it runs, else the short path if n <= max_short_query, else SDPA (the
    benchmark sets the bounds to time each path; None: MAX_KERNEL_DECODE_ROWS with the decode
    kernel, else MAX_DECODE_ROWS).
    decode_kernel, prefill_kernel: whether decode rows, and sequences past the short path, take
    the C kernels (None: where they run)."""
    qsl = query_start_loc.long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = seq_lens.long()
    block_size, device = k_cache.shape[1], k_cache.device
    if decode_kernel is None:
        decode_kernel = cpu_decode_attention.runs_on(k_cache)
    if max_decode_rows is None:
        max_decode_rows = MAX_KERNEL_DECODE_ROWS if decode_kernel else MAX_DECODE_ROWS
    if prefill_kernel is None:
        prefill_kernel = cpu_prefill_attention.runs_on(k_cache, num_q_heads)
    # The C prefill kernel beats the short path at every length past the decode rows (stop 42
    # in docs/benchmarks.md: 2-5x in fp32, 1.0-2.5x in bf16), so with it there is no short path.
    max_short_query = max_decode_rows if prefill_kernel else max(max_short_query, max_decode_rows)
    long = (query_lens > max_short_query).nonzero().flatten()
    kernel_prefill = _plan_kernel_prefill(long, qsl, query_lens, seq_lens, block_tables, block_size) \
        if prefill_kernel and long.numel() else None
    prefills = []
    for s in ([] if prefill_kernel else long.tolist()):
        n, seq_len = int(query_lens[s]), int(seq_lens[s])
        blocks = block_tables[s, :-(-seq_len // block_size)].long()
        # Query i sits at position seq_len - n + i and sees the keys up to there.
        positions = torch.arange(seq_len, device=device)
        mask = None if n == seq_len else positions[None, :] <= positions[seq_len - n:, None]
        prefills.append(PrefillPlan(int(qsl[s]), n, seq_len, blocks, mask))
    # Short sequences by length, in groups whose gathered K and V stay under the budget: one
    # long context does not pad the others, and a group's copy is bounded however big the batch.
    short = ((query_lens > max_decode_rows) & (query_lens <= max_short_query)).nonzero().flatten()
    short = short[seq_lens[short].argsort(stable=True)]
    per_position = 2 * k_cache.shape[2] * k_cache.shape[3]
    groups: list[list[int]] = []
    for s, seq_len in zip(short.tolist(), seq_lens[short].tolist()):
        width = -(-seq_len // block_size) * block_size
        if not groups or (len(groups[-1]) + 1) * width * per_position > SHORT_GROUP_ELEMENTS:
            groups.append([])
        groups[-1].append(s)
    shorts = [_plan_short(qsl[g], query_lens[g], seq_lens[g], block_tables[g].long(), k_cache)
              for g in (torch.tensor(group, device=device) for group in groups)]
    decode = ((query_lens >= 1) & (query_lens <= max_decode_rows)).nonzero().flatten()
    if decode.numel() == 0:
        return AttentionPlan(None, prefills, shorts, decode_kernel, kernel_prefill)
    # A sequence with n new tokens is n decode rows over its block table, row i one of
    # seq_len - n + i + 1 tokens: the lengths alone make it causal.
    n = query_lens[decode]
    seq = decode.repeat_interleave(n)
    offset = torch.arange(seq.numel(), device=device) - (n.cumsum(0) - n).repeat_interleave(n)
    lens = seq_lens[seq] - query_lens[seq] + offset + 1
    return AttentionPlan(_plan_decode(qsl[seq] + offset, lens, block_tables[seq], k_cache,
                                      num_q_heads, decode_kernel), prefills, shorts, decode_kernel,
                         kernel_prefill)


def _plan_kernel_prefill(seqs, qsl, query_lens, seq_lens, block_tables, block_size) -> KernelPrefillPlan:
    max_blocks = -(-int(seq_lens[seqs].max()) // block_size)
    return KernelPrefillPlan(qsl[seqs].to(torch.int32), query_lens[seqs].to(torch.int32),
                             seq_lens[seqs].to(torch.int32),
                             block_tables[seqs, :max_blocks].to(torch.int32).contiguous())


def _plan_short(starts, query_lens, lens, tables, k_cache) -> ShortPlan:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = lens.device
    index_dtype = torch.int32 if k_cache.numel() < 2**31 else torch.int64
    max_q = int(query_lens.max())
    max_blocks = -(-int(lens.max()) // block_size)
    width = max_blocks * block_size
    q_idx = torch.arange(max_q, device=device)
    used = (q_idx < query_lens[:, None]).flatten().nonzero().flatten()
    q_idx = torch.minimum(q_idx, query_lens[:, None] - 1)           # [S, M]
    # Entries past a sequence's last block may hold anything: never index through them.
    block_used = torch.arange(max_blocks, device=device) * block_size < lens[:, None]
    tables = torch.where(block_used, tables[:, :max_blocks], tables[:, :1])
    kv_head = torch.arange(num_kv_heads, device=device)[:, None, None]
    dims = torch.arange(head_dim, device=device)[:, None]
    k_rows = (tables[:, None, None, :] * num_kv_heads + kv_head) * head_dim + dims
    positions = torch.arange(width, device=device)
    slots = tables.repeat_interleave(block_size, 1) * block_size + positions % block_size
    # A zero probability times stale NaN is NaN: keys past seq_len read position 0's value.
    slots = torch.where(positions < lens[:, None], slots, slots[:, :1])
    v_rows = slots[:, None, :] * num_kv_heads + kv_head[:, 0]
    # Query i sits at position seq_len - n + i (padding queries copy the last one's). Every key
    # before the group's first query is seen by all: the mask covers only the keys after it.
    q_pos = (lens - query_lens)[:, None] + q_idx
    tail = int(q_pos.min())
    hidden = positions[None, None, tail:] > q_pos[:, :, None]
    q_rows = (starts[:, None] + q_idx).flatten()
    return ShortPlan(q_rows=q_rows, used=used, out_rows=q_rows[used],
                     k_rows=k_rows.to(index_dtype), v_rows=v_rows.to(index_dtype),
                     tail=tail, hidden=hidden[:, None, None])


def _plan_decode(rows, lens, tables, k_cache, num_q_heads, kernel: bool) -> DecodePlan:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = lens.device
    max_blocks = -(-int(lens.max()) // block_size)
    if kernel:  # it reads no table entry past a row's last block, and C checks no bounds
        if tables.shape[1] < max_blocks:
            raise ValueError(f"block tables of {tables.shape[1]} blocks for a row of {int(lens.max())} tokens")
        return DecodePlan(rows=rows, max_blocks=max_blocks, lens=lens.to(torch.int32),
                          tables=tables[:, :max_blocks].to(torch.int32).contiguous())
    tables = tables[:, :max_blocks].long()
    # Indices into the K and V tables; int32 halves what every layer reads when it fits.
    index_dtype = torch.int32 if k_cache.numel() < 2**31 else torch.int64
    num_seqs = lens.numel()
    width = max_blocks * block_size
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
        rows=rows, max_blocks=max_blocks, lens=lens, tables=tables.to(torch.int32), k_rows=k_rows, q_rows=score_rows // max_blocks,
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
    for short in plan.shorts:
        _short(q, k_cache, v_cache, short, scale, out)
    for prefill in plan.prefills:
        _prefill(q, k_cache, v_cache, prefill, scale, out)
    if plan.kernel_prefill is not None:
        p = plan.kernel_prefill
        cpu_prefill_attention.prefill(q, k_cache, v_cache, p.starts, p.num_tokens, p.lens, p.tables, scale, out)
    return out


def _decode(q, k_cache, v_cache, plan: DecodePlan, scale, out) -> None:
    if plan.k_rows is None:
        cpu_decode_attention.decode(q, k_cache, v_cache, plan.rows, plan.lens, plan.tables, scale, out)
        return
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


def _short(q, k_cache, v_cache, plan: ShortPlan, scale, out) -> None:
    num_q_heads, head_dim = q.shape[1:]
    num_seqs, num_kv_heads, _, max_blocks = plan.k_rows.shape
    block_size = k_cache.shape[1]
    width = max_blocks * block_size
    group = num_q_heads // num_kv_heads
    # The G heads sharing a kv head are stacked as more query rows: [S, Hkv, G * M, D] against
    # keys [S, Hkv, D, W], one batched matmul; K blocks already hold their keys transposed.
    queries = (q.index_select(0, plan.q_rows) * scale).to(k_cache.dtype)
    queries = queries.view(num_seqs, -1, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    queries = queries.reshape(num_seqs, num_kv_heads, -1, head_dim)
    keys = F.embedding(plan.k_rows, k_cache.view(-1, block_size))
    scores = torch.matmul(queries, keys.view(num_seqs, num_kv_heads, head_dim, width))
    scores = scores.view(num_seqs, num_kv_heads, group, -1, width)
    scores[..., plan.tail:].masked_fill_(plan.hidden, float("-inf"))  # NaN there is no key
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(v_cache.dtype)
    values = F.embedding(plan.v_rows, v_cache.view(-1, head_dim))   # [S, Hkv, W, D]
    rows = torch.matmul(probs.view(num_seqs, num_kv_heads, -1, width), values)
    rows = rows.view(num_seqs, num_kv_heads, group, -1, head_dim).permute(0, 3, 1, 2, 4)
    rows = rows.reshape(-1, num_q_heads, head_dim).index_select(0, plan.used)
    out.index_copy_(0, plan.out_rows, rows.to(out.dtype))


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
