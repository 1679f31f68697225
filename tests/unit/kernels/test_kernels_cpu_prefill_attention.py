"""kernels/csrc/cpu_prefill_attention.c against float64 (kernels/reference.py) on a poisoned cache
(NaN in every slot no sequence owns, table entries past each sequence's last block pointing at a
NaN block), on every instruction set this CPU has (the test names them), fp32 and bf16, with and
without cached context before the new tokens, and with two threads (tiles taken in any order)."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_attention, cpu_prefill_attention
from tests.unit.kernels.test_kernels import Batch

# (cached context lengths, new tokens, q heads, kv heads, head dim, block size): tiles of 16
# queries whole and cut, chunks of 16 keys inside blocks of 32 (and the tiles' of 32 across blocks of
# 16), GQA 1 to 8, head dims past 64 (96: the tiles' P V in one pass of 4 tiles and one of 2).
CASES = {
    "smollm2_fresh": ([0, 0, 0], [256, 37, 16], 9, 3, 64, 16),
    "smollm2_cached": ([48, 130, 5], [40, 18, 70], 9, 3, 64, 16),
    "gqa1_block_32": ([0, 33], [50, 31], 4, 4, 64, 32),
    "gqa8_head_dim_128": ([17, 0], [45, 20], 8, 1, 128, 16),
    "head_dim_80": ([3], [29], 6, 2, 80, 16),
    "head_dim_96": ([7], [40], 4, 2, 96, 16),
    "head_dim_16_one_token": ([20, 0], [1, 2], 2, 1, 16, 16),
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# Peaked scores reach hundreds, and fp32's rounding of each (about 3e-5 there) moves the weights
# by as much: the decode kernel, and any fp32 summation order, differ from float64 by 4e-5 on
# these cases.
TOL_PEAKED_FP32 = 1e-4


def _run(batch: Batch, isa: int) -> torch.Tensor:
    k_cache = torch.empty(batch.k_cache.shape, dtype=batch.dtype)
    cpu_attention.key_blocks(k_cache).copy_(batch.k_cache.permute(0, 2, 3, 1))
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.dtype)
    qsl = batch.query_start_loc.long()
    cpu_prefill_attention.prefill(batch.q, k_cache, batch.v_cache, qsl[:-1], qsl[1:] - qsl[:-1],
                                  batch.seq_lens, batch.block_tables, batch.scale, out, isa=isa)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("peaked", [False, True], ids=["plain", "peaked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_the_prefill_kernel_equals_float64_on_every_isa_here(case, dtype, peaked, threads):
    if not cpu_prefill_attention.available():
        pytest.skip(f"no prefill attention kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    ctx, new, hq, hkv, d, bs = CASES[case]
    batch = Batch(ctx, new, hq, hkv, d, bs, dtype, seed=list(CASES).index(case))
    if peaked:  # scores up to hundreds: the running max moves and exp underflows
        batch.q = batch.q * 30
    _, want = batch.expected()
    isas = cpu_prefill_attention.supported_isas()
    print(f"prefill attention paths here: {[cpu_prefill_attention.ISA_NAMES[i] for i in isas]}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in isas:
            out = _run(batch, isa)
            name = cpu_prefill_attention.ISA_NAMES[isa]
            assert not out.isnan().any(), name
            err = (out.double() - want).abs().max().item()
            assert err <= (TOL_PEAKED_FP32 if peaked and dtype == torch.float32 else TOL[dtype]), (name, err)
    finally:
        torch.set_num_threads(before)


def test_rows_of_other_sequences_are_left_alone():
    """A step's decode rows sit between its prefill chunks in q and out: the kernel writes only
    the rows of the sequences it is given."""
    if not cpu_prefill_attention.available():
        pytest.skip("no prefill attention kernel on this CPU")
    batch = Batch([0, 9, 0], [20, 1, 17], 4, 2, 32, 16, torch.float32, seed=7)
    k_cache = torch.empty(batch.k_cache.shape)
    cpu_attention.key_blocks(k_cache).copy_(batch.k_cache.permute(0, 2, 3, 1))
    out = torch.full(batch.q.shape, 7.0)
    pick = torch.tensor([0, 2])
    qsl = batch.query_start_loc.long()
    cpu_prefill_attention.prefill(batch.q, k_cache, batch.v_cache, qsl[pick], (qsl[1:] - qsl[:-1])[pick],
                                  batch.seq_lens[pick], batch.block_tables[pick], batch.scale, out)
    _, want = batch.expected()
    assert bool((out[20] == 7.0).all())
    mine = torch.cat([torch.arange(0, 20), torch.arange(21, 38)])
    assert (out[mine].double() - want[mine]).abs().max().item() <= TOL[torch.float32]


def test_queries_of_another_dtype_go_through_fp32_and_land_in_their_rows():
    """fp16 queries over an fp32 cache (the kernel computes fp32 or bf16 only): the rows come back
    in fp16, equal to float64 within fp16's rounding, and the other rows of out are untouched."""
    if not cpu_prefill_attention.available():
        pytest.skip("no prefill attention kernel on this CPU")
    batch = Batch([5, 0], [30, 1], 4, 2, 32, 16, torch.float32, seed=9)
    k_cache = torch.empty(batch.k_cache.shape)
    cpu_attention.key_blocks(k_cache).copy_(batch.k_cache.permute(0, 2, 3, 1))
    q = batch.q.half()
    out = torch.full(q.shape, 7.0, dtype=torch.float16)
    cpu_prefill_attention.prefill(q, k_cache, batch.v_cache, torch.tensor([0]), torch.tensor([30]),
                                  batch.seq_lens[:1], batch.block_tables[:1], batch.scale, out)
    batch.q = q.float()  # the reference on the fp16 queries' own values
    _, want = batch.expected()
    assert out.dtype == torch.float16 and bool((out[30] == 7.0).all())
    assert (out[:30].double() - want[:30]).abs().max().item() <= 2e-3


def test_queries_read_in_place_from_the_fused_projection_give_the_same_bits():
    """q as a worker passes it, the first Hq heads of each row of the fused qkv output: read with
    its row stride, not copied, and the same output as from a contiguous q."""
    if not cpu_prefill_attention.available():
        pytest.skip("no prefill attention kernel on this CPU")
    batch = Batch([3, 0], [25, 18], 6, 2, 32, 16, torch.bfloat16, seed=11)
    k_cache = torch.empty(batch.k_cache.shape, dtype=torch.bfloat16)
    cpu_attention.key_blocks(k_cache).copy_(batch.k_cache.permute(0, 2, 3, 1))
    qkv = torch.cat([batch.q.flatten(1), torch.randn(batch.q.shape[0], 2 * 2 * 32).bfloat16()], 1)
    strided = qkv[:, :6 * 32].view(-1, 6, 32)
    assert not strided.is_contiguous()
    qsl = batch.query_start_loc.long()
    outs = []
    for q in (strided, batch.q.contiguous()):
        out = torch.full(batch.q.shape, float("nan"), dtype=torch.bfloat16)
        cpu_prefill_attention.prefill(q, k_cache, batch.v_cache, qsl[:-1], qsl[1:] - qsl[:-1],
                                      batch.seq_lens, batch.block_tables, batch.scale, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
