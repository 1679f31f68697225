"""The Triton paged attention on speculative verification steps against the float64 loop of
kernels/reference.py: a speculating sequence has 1 + p query rows (p proposals, up to
MAX_SPECULATIVE_TOKENS = 16) over its paged context, beside plain decodes (worker/speculation/speculator.py).

choose_config gives such a step the narrow decode tiles while each query fits one (1 + k rows
<= 16 // GQA group: k <= 4 for SmolLM2's group of 3, k <= 15 for group 1), split-KV on top when
few sequences hold long contexts, and the wide prefill tiles past that. Each case is named for the
path it takes in bfloat16 on an H100/H200 (132 SMs); test_case_takes_its_named_path checks the
names on any machine (host code only).

The kernel cases need CUDA (the GPU check, bench/gpu_check.sh, runs them compiled): on the CPU
suite's interpreter they would take minutes, and test_kernels.py's verify_k4 and short_gqa8
already run there. PAGODA_KERNEL_INTERPRET=1 runs them on the CPU under the Triton interpreter
(float32 only), to check the cases themselves without a GPU.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # as tests/conftest.py does, for a run without it: before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
RUN_KERNELS = CUDA or os.environ.get("PAGODA_KERNEL_INTERPRET") == "1"
if RUN_KERNELS:  # (skips this module with it where Triton cannot run)
    from tests.unit.kernels.test_kernels import DEVICE, TOL_F64, Batch

from pagoda.kernels import triton_attention as ta  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py
needs_kernels = pytest.mark.skipif(not RUN_KERNELS, reason="needs a CUDA GPU (or PAGODA_KERNEL_INTERPRET=1)")
# bfloat16 is what the engine runs on CUDA; float32 the exact one ("ieee" dots, other tiles).
# float16 verify rows run in test_kernels.py (verify_k4). The interpreter has no bfloat16.
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
SMOLLM2 = (9, 3, 64, 16)                                  # query heads, kv heads, head_dim, block
# Every verification length 2..17 (k = 16) over a context, some from position 0, some across a
# block edge, beside decodes: the CPU test's batch (test_kernels_cpu_attention_short_queries.py).
EVERY_LENGTH = ([(0, 1), (15, 1), (16, 1), (37, 1)]
                + list(zip((0, 14, 30, 0, 13, 47, 9, 120, 2, 31, 16, 59, 5, 80, 1, 0), range(2, 18))))

# name: (context lengths, query lengths, (hq, hkv, head_dim, block_size), run kwargs, path)
CASES = {
    # k = 4 on SmolLM2's heads: 5 rows fill a decode tile (BLOCK_Q 5); block edges on both sides.
    "k4_decode": ([0, 11, 15, 16, 31, 47, 63, 100, 130, 7], [5, 5, 2, 4, 1, 3, 5, 5, 1, 5],
                  SMOLLM2, {}, "decode"),
    # Few sequences, long contexts: the decode tiles split the keys (16 segments).
    "k4_split": ([1500, 700, 3000], [5, 3, 5], SMOLLM2, {}, "split"),
    # Split forced on short contexts: some segments get no key tile at all.
    "k4_split8_forced": ([0, 11, 15, 16, 31, 47, 63, 100, 130, 7], [5, 5, 2, 4, 1, 3, 5, 5, 1, 5],
                         SMOLLM2, {"num_kv_splits": 8}, "split"),
    # Blocks of 32: a verification straddles a block edge in each sequence.
    "k4_block32": ([29, 30, 61, 62, 95], [5, 5, 5, 4, 5], (9, 3, 64, 32), {}, "decode"),
    # k = 16 (suffix's default): every length 2..17; past 5 rows the prefill tiles take them.
    "k16_every_length": ([c for c, _ in EVERY_LENGTH], [n for _, n in EVERY_LENGTH], SMOLLM2, {},
                         "prefill"),
    # 17 rows over a long context (many unmasked key tiles, then the causal one).
    "k16_long": ([2000, 40, 333], [17, 9, 17], SMOLLM2, {}, "prefill"),
    # GQA 1 (no group sharing a tile): up to 16 rows fit a decode tile; long ones split.
    "gqa1_k15_split": ([200, 1000, 33, 0, 17], [16, 9, 16, 12, 1], (8, 8, 128, 16), {}, "split"),
    # GQA 8 (one kv head): a decode tile holds 2 tokens, so k = 1 ...
    "gqa8_k1_split": ([40, 500, 16, 1], [2, 2, 1, 2], (8, 1, 64, 16), {}, "split"),
    # ... and k = 4 takes the prefill tiles.
    "gqa8_k4_prefill": ([40, 500, 16, 1], [5, 5, 1, 3], (8, 1, 64, 16), {}, "prefill"),
    # Llama-3-8B's heads (32 / 8, D 128): k = 3 fills a decode tile; long contexts split.
    "gqa4_k3_split": ([4000, 100, 2048, 15], [4, 4, 1, 3], (32, 8, 128, 16), {}, "split"),
}


def test_case_takes_its_named_path():
    for name, (ctx, q, (hq, hkv, d, _bs), kwargs, path) in CASES.items():
        cfg = ta.choose_config(hq, hkv, d, torch.bfloat16, len(ctx),
                               max(c + n for c, n in zip(ctx, q)), max(q), 132,
                               kwargs.get("num_kv_splits"))
        decode = cfg.block_m == max(16, 1 << (hq // hkv - 1).bit_length())
        took = ("split" if cfg.num_segments > 1 else "decode") if decode else "prefill"
        assert took == path, f"{name}: {took} ({cfg}), named {path}"
        if path != "prefill":
            assert cfg.block_q >= max(q), name       # one tile holds each whole verification


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_verification_step(case, dtype):
    """With the hints the worker passes (max_query_len = the widest verification), and without."""
    ctx, q, (hq, hkv, d, bs), kwargs, _path = CASES[case]
    batch = Batch(ctx, q, hq, hkv, d, bs, dtype, seed=list(CASES).index(case))
    batch.check(batch.run(**kwargs))
    if case == "k4_decode":
        batch.check(batch.run(max_seq_len=None, max_query_len=None))


@needs_kernels
@pytest.mark.parametrize("next_rows", [1, 5], ids=["then_decode", "then_verify"])
@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_rejected_proposals_are_rewritten_or_left_unread(accepted, next_rows):
    """Step n writes the K/V of a decode token and 4 proposals, of which `accepted` are kept;
    step n + 1 (a decode, or 5 rows of a new verification) writes from there: over some rejected
    slots, leaving the others stale past seq_len. The output must be that of a cache that never
    held the rejected proposals."""
    hq, hkv, d, bs = SMOLLM2
    dtype = DTYPES[-1]
    gen = torch.Generator().manual_seed(accepted)
    ctx, num_blocks = 45, 8
    table = torch.randperm(num_blocks, generator=gen)[:4].to(torch.int32)

    def slots(start, n):
        pos = torch.arange(start, start + n)
        return (table[pos // bs].long() * bs + pos % bs).to(DEVICE)

    def kv(n):
        return [torch.randn(n, hkv, d, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]

    caches = [torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    kept = ctx + 1 + accepted
    writes = [(*kv(ctx), 0), (*kv(5), ctx), (*kv(next_rows), kept)]   # prefix, step n, step n + 1
    for i, (k, v, start) in enumerate(writes):
        ta.write_kv(k, v, caches[0], caches[1], slots(start, len(k)))
        keep = len(k) if i != 1 else 1 + accepted                     # the clean cache's share
        ta.write_kv(k[:keep], v[:keep], caches[2], caches[3], slots(start, keep))
    q = torch.randn(next_rows, hq, d, generator=gen).to(dtype).to(DEVICE)
    tables = table[None].to(DEVICE)
    seq_lens = torch.tensor([kept + next_rows], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, next_rows], dtype=torch.int32, device=DEVICE)
    out = ta.paged_attention(q, caches[0], caches[1], tables, seq_lens, qsl, d ** -0.5,
                             max_seq_len=kept + next_rows, max_query_len=next_rows)
    from pagoda.kernels import reference as ref
    want = ref.paged_attention_float64(q.cpu(), caches[2].cpu(), caches[3].cpu(), tables.cpu(),
                                       seq_lens.cpu(), qsl.cpu(), d ** -0.5)
    assert (out.double().cpu() - want).abs().max().item() <= TOL_F64[dtype]
