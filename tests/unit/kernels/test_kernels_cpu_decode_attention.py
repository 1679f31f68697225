"""kernels/csrc/cpu_decode_attention.c against float64 (kernels/reference.py) on a poisoned cache (NaN
in every slot no sequence owns, table entries past each sequence's last block pointing at a NaN
block), on every instruction set this CPU has (the test names them), fp32 and bf16 caches, with the
query heads of a kv head attended one by one and together (where the shapes allow), the kernel's
prefetch on and off."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_attention, cpu_decode_attention
from tests.unit.kernels.test_kernels import Batch

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

# (context lengths before the one new token, q heads, kv heads, head dim, block size)
CASES = {
    "gqa1_block_edges": ([0, 15, 16, 37, 150], 4, 4, 64, 16),
    "smollm2": ([37, 200, 0, 130, 15, 600], 9, 3, 64, 16),
    "gqa4": ([5, 64, 250, 31], 8, 2, 64, 16),
    "gqa8_long": ([300, 90], 8, 1, 64, 16),
    "gqa2_head_dim_96": ([10, 33, 70], 4, 2, 96, 16),  # bf16 pairs: a 64-value pass, then a 32
    "head_dim_40_block_8": ([20, 50, 3], 4, 2, 40, 8),
    "head_dim_128_block_32": ([40, 70, 15], 6, 2, 128, 32),
    "odd_block_5": ([7, 22, 4], 2, 1, 24, 5),
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _key_layout(batch: Batch) -> torch.Tensor:
    k_cache = torch.empty(batch.k_cache.shape, dtype=batch.dtype)
    cpu_attention.key_blocks(k_cache).copy_(batch.k_cache.permute(0, 2, 3, 1))
    return k_cache


@pytest.mark.parametrize("peaked", [False, True], ids=["plain", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_the_decode_kernel_equals_float64_on_every_isa_here(case, dtype, peaked):
    if not cpu_decode_attention.available():
        pytest.skip(f"no decode attention kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    ctx_lens, hq, hkv, d, bs = CASES[case]
    batch = Batch(ctx_lens, [1] * len(ctx_lens), hq, hkv, d, bs, dtype, seed=list(CASES).index(case))
    if peaked:  # scores up to hundreds: the softmax's shift and exp's underflow matter
        batch.q = batch.q * 30
    k_cache = _key_layout(batch)
    rows = torch.arange(len(ctx_lens))
    isas = cpu_decode_attention.supported_isas()
    print(f"decode attention paths here: {[cpu_decode_attention.ISA_NAMES[i] for i in isas]}")
    _, want = batch.expected()
    for isa in isas:
        for grouping in (0, 1):
            outs = []
            for ahead in (False, True):  # the kernel's own prefetch off and on: the same sums
                out = torch.full(batch.q.shape, float("nan"), dtype=dtype)
                cpu_decode_attention.decode(batch.q, k_cache, batch.v_cache, rows, batch.seq_lens,
                                            batch.block_tables, batch.scale, out, isa=isa, grouping=grouping,
                                            ahead=ahead)
                said = (cpu_decode_attention.ISA_NAMES[isa], f"grouping {grouping}", f"prefetch {ahead}")
                assert not out.isnan().any(), said
                err = (out.double() - want).abs().max().item()
                assert err <= TOL[dtype], (*said, err)
                outs.append(out)
            assert torch.equal(*outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_threads_split_the_rows_by_their_lengths_and_every_task_runs_once(dtype):
    """A thread's share is its part of the positions read, not of the tasks: rows of very uneven
    lengths over 2, 3 and 7 threads (more than one row's tasks), with the heads one by one and by
    kv head, give the one-thread output bit for bit (each task's sums are its own), and no row or
    head is left unwritten (out starts as NaN) or written twice."""
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    ctx_lens = [600, 3, 0, 450, 17, 16, 999, 1, 64]
    batch = Batch(ctx_lens, [1] * len(ctx_lens), 9, 3, 64, 16, dtype, seed=11)
    k_cache = _key_layout(batch)
    _, want = batch.expected()
    for rows in (torch.arange(len(ctx_lens)), torch.tensor([6])):
        for grouping in (0, 1):
            outs = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                out = torch.full(batch.q.shape, float("nan"), dtype=dtype)
                cpu_decode_attention.decode(batch.q, k_cache, batch.v_cache, rows, batch.seq_lens[rows],
                                            batch.block_tables[rows], batch.scale, out, grouping=grouping)
                outs.append(out[rows])
            said = (f"rows {rows.tolist()}", f"grouping {grouping}")
            assert not outs[0].isnan().any(), said
            assert (outs[0].double() - want[rows]).abs().max().item() <= TOL[dtype], said
            assert all(torch.equal(outs[0], o) for o in outs[1:]), said


def test_rows_it_is_not_given_are_left_alone_and_rows_map_to_their_tokens():
    """Decode rows scattered among other tokens (a prefill chunk's, say): each lands in its own
    row of out, and out's other rows keep what they held."""
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    batch = Batch([30, 5, 64], [1, 1, 1], 9, 3, 64, 16, torch.float32, seed=7)
    k_cache = _key_layout(batch)
    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(1))
    q[[4, 0, 2]] = batch.q
    out = torch.full_like(q, 7.0)
    cpu_decode_attention.decode(q, k_cache, batch.v_cache, torch.tensor([4, 0, 2]), batch.seq_lens,
                                batch.block_tables, batch.scale, out)
    _, want = batch.expected()
    assert (out[[4, 0, 2]].double() - want).abs().max().item() <= TOL[torch.float32]
    assert bool((out[[1, 3, 5]] == 7.0).all())


@pytest.mark.parametrize("grouping", [0, 1])
def test_bf16_q_and_out_are_read_and_written_in_place_as_their_fp32_rounded(grouping):
    """A bf16 model's q (rows of the fused qkv projection: a row stride past its heads) and out:
    the kernel reads and writes them where they lie, and out's rows are the fp32 outputs rounded
    to nearest even, bit for bit; other rows of out are left alone."""
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    batch = Batch([30, 5, 64], [1, 1, 1], 9, 3, 64, 16, torch.bfloat16, seed=8)
    k_cache = _key_layout(batch)
    qkv = torch.randn(6, 15 * 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    q = qkv[:, :9 * 64].view(6, 9, 64)
    q[[4, 0, 2]] = batch.q.bfloat16()
    rows = torch.tensor([4, 0, 2])
    for isa in cpu_decode_attention.supported_isas():
        out = torch.full((6, 9, 64), 7.0, dtype=torch.bfloat16)
        wide = torch.full((6, 9, 64), 7.0)
        cpu_decode_attention.decode(q, k_cache, batch.v_cache, rows, batch.seq_lens, batch.block_tables,
                                    batch.scale, out, isa=isa, grouping=grouping)
        cpu_decode_attention.decode(q.float(), k_cache, batch.v_cache, rows, batch.seq_lens,
                                    batch.block_tables, batch.scale, wide, isa=isa, grouping=grouping)
        assert torch.equal(out[rows], wide[rows].bfloat16()), cpu_decode_attention.ISA_NAMES[isa]
        assert bool((out[[1, 3, 5]] == 7.0).all())


def test_a_block_table_too_short_for_its_row_is_refused_before_the_kernel_reads_past_it():
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    batch = Batch([40], [1], 4, 2, 64, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="block tables of 2 blocks for a row of 41 tokens"):
        cpu_attention.plan_attention(batch.block_tables[:, :2], batch.seq_lens, batch.query_start_loc,
                                     _key_layout(batch), 4)
