"""The CPU attention backend on speculative-verification batches (kernels/cpu_attention.py):
sequences with a few new tokens take the decode or the short path, not a per-sequence SDPA over
a copy of the context. Every path against the float64 loop of kernels/reference.py, on a cache
whose unowned slots hold NaN and Inf."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_attention as cpu
from pagoda.kernels import cpu_prefill_attention
from pagoda.kernels import reference as ref

# As TOL_F64 in tests/unit/kernels/test_kernels.py (not imported: that module needs Triton).
TOL_F64 = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HQ, HKV, D, BS = 9, 3, 64, 16                                        # SmolLM2-135M's attention

# (context before the new tokens, new tokens): decodes (a first token, block edges), every short
# length 2..17 (some the whole sequence, some crossing a block edge), one sequence with nothing
# new, and prefill chunks longer than MAX_SHORT_QUERY.
SEQS = ([(0, 1), (15, 1), (16, 1), (37, 1), (20, 0), (0, 40), (24, 40), (3, 64)]
        + [(ctx, m) for m, ctx in zip(range(2, 18), (0, 14, 30, 0, 13, 47, 9, 120, 2, 31, 16,
                                                     59, 5, 80, 1, 0))])


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py


class Batch:
    """Sequences in shuffled blocks of a cache in the backend's layout. The slots no sequence owns
    hold NaN, +Inf and -Inf, and table entries past each sequence's last block point at a block
    of them: a key or value read past seq_len turns the output into NaN."""

    def __init__(self, seqs, dtype, seed=0, extra_rows=2):
        gen = torch.Generator().manual_seed(seed)
        lens = [ctx + n for ctx, n in seqs]
        blocks = [-(-s // BS) for s in lens]
        num_blocks = sum(blocks) + 4
        poison = torch.tensor([float("nan"), float("inf"), float("-inf")])
        stale = poison[torch.randint(3, (num_blocks, BS, HKV, D), generator=gen)]
        k, v = stale.clone(), stale.flip(-1).clone()
        order = torch.randperm(num_blocks - 1, generator=gen)        # the last block: all stale
        self.tables = torch.full((len(seqs), max(blocks) + 2), num_blocks - 1, dtype=torch.int32)
        used = 0
        for s, (seq_len, nb) in enumerate(zip(lens, blocks)):
            ids = order[used:used + nb]
            used += nb
            self.tables[s, :nb] = ids.int()
            for pos in range(seq_len):
                b, o = int(ids[pos // BS]), pos % BS
                k[b, o], v[b, o] = torch.randn(2, HKV, D, generator=gen)
        self.clean_k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0).to(dtype)
        self.clean_v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0).to(dtype)
        self.k_cache = torch.empty(k.shape, dtype=dtype)
        cpu.key_blocks(self.k_cache).copy_(k.permute(0, 2, 3, 1))
        self.v_cache = v.to(dtype)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.qsl = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0).int()
        self.num_tokens = int(self.qsl[-1])
        self.q = torch.randn(self.num_tokens + extra_rows, HQ, D, generator=gen).to(dtype)
        self.scale = D ** -0.5

    def plan(self, **bounds):
        return cpu.plan_attention(self.tables, self.seq_lens, self.qsl, self.k_cache, HQ, **bounds)

    def run(self, plan):
        out = torch.full_like(self.q, float("nan"))
        out[self.num_tokens:] = 7.0                                  # rows past the batch
        assert cpu.paged_attention(self.q, self.k_cache, self.v_cache, plan, self.scale, out) is out
        assert (out[self.num_tokens:] == 7.0).all()
        return out[:self.num_tokens]

    def want(self):
        return ref.paged_attention_float64(self.q[:self.num_tokens], self.clean_k, self.clean_v,
                                           self.tables, self.seq_lens, self.qsl, self.scale)


def rows_of(batch, keep):
    """The q rows of the sequences whose number of new tokens passes keep."""
    qsl = batch.qsl.tolist()
    return sorted(r for s in range(len(qsl) - 1) if keep(qsl[s + 1] - qsl[s])
                  for r in range(qsl[s], qsl[s + 1]))


def paths(plan):
    """The q rows each path writes (prefill chunks: SDPA's or the C kernel's)."""
    chunks = [(p.start, p.num_tokens) for p in plan.prefills]
    if plan.kernel_prefill is not None:
        chunks += zip(plan.kernel_prefill.starts.tolist(), plan.kernel_prefill.num_tokens.tolist())
    return (sorted(plan.decode.rows.tolist()) if plan.decode is not None else [],
            sorted(r for short in plan.shorts for r in short.out_rows.tolist()),
            sorted(r for start, n in chunks for r in range(start, start + n)))


def check(out, want):
    assert not out.isnan().any(), "unwritten or NaN output rows"
    err = (out.double() - want).abs().max().item()
    assert err <= TOL_F64[out.dtype], f"max error {err:.2e} against float64"


@pytest.mark.parametrize("prefill_kernel", [None, False], ids=["chunks-by-kernel-here", "chunks-by-sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mixed_batch_takes_each_path_by_length_and_matches_float64(dtype, prefill_kernel):
    batch = Batch(SEQS, dtype, seed=1)
    plan = batch.plan(prefill_kernel=prefill_kernel)
    from pagoda.kernels import cpu_decode_attention
    # With the C decode kernel (fp32 and bf16 caches, where it runs) decode rows reach further.
    assert plan.kernel == (dtype != torch.float16 and cpu_decode_attention.available())
    rows = cpu.MAX_KERNEL_DECODE_ROWS if plan.kernel else cpu.MAX_DECODE_ROWS
    # With the C prefill kernel every sequence past the decode rows takes it: no short path.
    kernel = prefill_kernel is None and dtype != torch.float16 and cpu_prefill_attention.available()
    short = rows if kernel else cpu.MAX_SHORT_QUERY
    assert 1 < cpu.MAX_SHORT_QUERY < 40                              # SDPA's chunks exist too
    assert paths(plan) == (
        rows_of(batch, lambda n: 1 <= n <= rows),
        rows_of(batch, lambda n: rows < n <= short),
        rows_of(batch, lambda n: n > short))
    assert (plan.kernel_prefill is not None) == kernel and bool(plan.shorts) == (not kernel)
    assert plan.decode is not None
    want = batch.want()
    check(batch.run(plan), want)
    # The plan is built once per step: it serves every layer's cache.
    batch.k_cache, batch.v_cache = batch.k_cache * 0.5, batch.v_cache * -1
    batch.clean_k, batch.clean_v = batch.clean_k * 0.5, batch.clean_v * -1
    check(batch.run(plan), batch.want())


@pytest.mark.parametrize("prefill_kernel", [None, False], ids=["chunks-by-kernel-here", "chunks-by-sdpa"])
@pytest.mark.parametrize("bounds", [(0, 0), (64, 64), (0, 64), (2, 17)],
                         ids=["all-chunks", "all-decode-rows", "all-short", "rows-then-short"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_path_serves_every_query_length(dtype, bounds, prefill_kernel):
    """Each path alone on every length, so that a bound moved after a new measurement moves
    sequences between correct paths; none reads a block table entry past a sequence's blocks.
    With the C prefill kernel the short path's bound is moot: past the decode rows is the kernel."""
    batch = Batch(SEQS, dtype, seed=2)
    batch.tables[batch.tables == batch.tables.max()] = 10**6         # padding past the cache
    rows, short = bounds
    plan = batch.plan(max_decode_rows=rows, max_short_query=short, prefill_kernel=prefill_kernel)
    kernel = prefill_kernel is None and cpu_prefill_attention.available()
    if kernel:
        short = rows
    assert (plan.kernel_prefill is not None) == (kernel and rows < 64)
    decode, shorts, prefills = paths(plan)
    assert decode == rows_of(batch, lambda n: 1 <= n <= rows)
    assert shorts == rows_of(batch, lambda n: rows < n <= max(rows, short))
    assert prefills == rows_of(batch, lambda n: n > max(rows, short))
    check(batch.run(plan), batch.want())


def test_short_groups_are_sorted_by_length_and_bounded(monkeypatch):
    """A small budget splits the short sequences into groups of similar lengths, each copying
    at most the budget of K and V unless a single sequence needs more."""
    monkeypatch.setattr(cpu, "SHORT_GROUP_ELEMENTS", 2 * HKV * D * 64)
    batch = Batch(SEQS, torch.float32, seed=3)
    plan = batch.plan(prefill_kernel=False)
    assert len(plan.shorts) > 3
    widths = [short.v_rows.shape[-1] for short in plan.shorts]
    assert widths == sorted(widths)
    for short in plan.shorts:
        gathered = short.k_rows.numel() * BS + short.v_rows.numel() * D
        assert gathered <= cpu.SHORT_GROUP_ELEMENTS or short.k_rows.shape[0] == 1
    check(batch.run(plan), batch.want())
