"""Triton paged attention and KV write against the torch reference and a float64 computation, and
the CPU backend's fused torch version (kernels/cpu_attention.py) against the same two.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (float32 and float16; the
interpreter has no bfloat16), so TRITON_INTERPRET is set before Triton is imported. With CUDA the
same tests run compiled on the GPU, plus bfloat16, CUDA-graph capture and speed checks.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

try:
    import triton  # noqa: E402
    from pagoda.kernels import cpu_attention as cpu  # noqa: E402
    from pagoda.kernels import reference as ref  # noqa: E402
    from pagoda.kernels import triton_attention as ta  # noqa: E402
    from pagoda.kernels import triton_paged  # noqa: E402
except Exception as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"Triton cannot run here: {exc}", allow_module_level=True)

if not CUDA and type(triton_paged.paged_attention_kernel).__name__ != "InterpretedFunction":
    # Imported earlier without TRITON_INTERPRET (by another test module): rebuild the kernels.
    triton_paged = importlib.reload(triton_paged)
    ta = importlib.reload(ta)

DEVICE = "cuda" if CUDA else "cpu"
REPO = Path(__file__).resolve().parents[3]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# Maximum absolute error against the float64 computation / against the torch reference.
TOL_F64 = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
TOL_REF = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 5e-2}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py


class Batch:
    """A batch of sequences over a paged cache, in two versions.

    The kernels get a poisoned version: the cache slots no sequence owns hold NaN and the block
    table entries past each sequence's last block point at a NaN block, so a key read beyond
    seq_len turns the output into NaN. The references get a clean copy (NaN -> 0, padding -> 0).
    """

    def __init__(self, ctx_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                 seed=0, spare_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.seq_lens_list = [c + n for c, n in zip(ctx_lens, q_lens)]
        self.q_lens = list(q_lens)
        blocks_per_seq = [-(-s // block_size) for s in self.seq_lens_list]
        num_blocks = sum(blocks_per_seq) + spare_blocks + 1
        poison_block = num_blocks - 1
        order = torch.randperm(num_blocks - 1, generator=gen)       # shuffled physical blocks
        width = max(blocks_per_seq) + 2
        tables = torch.full((len(ctx_lens), width), poison_block, dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = torch.full(shape, float("nan"))
        v = torch.full(shape, float("nan"))
        used = 0
        for s, (seq_len, n) in enumerate(zip(self.seq_lens_list, blocks_per_seq)):
            ids = order[used:used + n]
            used += n
            tables[s, :n] = ids.to(torch.int32)
            for pos in range(seq_len):
                b, o = int(ids[pos // block_size]), pos % block_size
                k[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen)
                v[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen)
        self.k_cache = k.to(dtype).to(DEVICE)
        self.v_cache = v.to(dtype).to(DEVICE)
        self.block_tables = tables.to(DEVICE)
        self.clean_k = torch.nan_to_num(self.k_cache, nan=0.0)
        self.clean_v = torch.nan_to_num(self.v_cache, nan=0.0)
        self.clean_tables = torch.where(tables == poison_block, 0, tables).to(DEVICE)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=DEVICE)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        self.num_tokens = starts[-1]
        q = torch.randn(self.num_tokens, num_q_heads, head_dim, generator=gen)
        self.q = q.to(dtype).to(DEVICE)
        self.scale = head_dim ** -0.5

    def run(self, **kwargs):
        out = torch.full_like(self.q, float("nan"))                 # unwritten rows fail
        kwargs.setdefault("max_seq_len", max(self.seq_lens_list))
        kwargs.setdefault("max_query_len", max(self.q_lens))
        res = ta.paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables,
                                 self.seq_lens, self.query_start_loc, self.scale, out=out, **kwargs)
        assert res is out
        return out

    def run_cpu(self, kernels=None):
        """The CPU backend on the same poisoned cache, its K blocks rearranged into its layout;
        decode rows and prefill chunks through kernels/csrc/cpu_decode_attention.c and
        cpu_prefill_attention.c where they run, or (kernels False) through torch ops."""
        k_cache = torch.empty(self.k_cache.shape, dtype=self.dtype)
        cpu.key_blocks(k_cache).copy_(self.k_cache.cpu().permute(0, 2, 3, 1))
        plan = cpu.plan_attention(self.block_tables.cpu(), self.seq_lens.cpu(),
                                  self.query_start_loc.cpu(), k_cache, self.q.shape[1],
                                  decode_kernel=kernels, prefill_kernel=kernels)
        out = torch.full(self.q.shape, float("nan"), dtype=self.dtype)
        res = cpu.paged_attention(self.q.cpu(), k_cache, self.v_cache.cpu(), plan, self.scale, out=out)
        assert res is out
        return out

    def args(self):
        return (self.q, self.clean_k, self.clean_v, self.clean_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def expected(self):
        return ref.paged_attention(*self.args()), ref.paged_attention_float64(
            *(a.cpu() if isinstance(a, torch.Tensor) else a for a in self.args()))

    def check(self, out):
        want_ref, want_f64 = self.expected()
        assert not out.isnan().any(), "unwritten or NaN output rows"
        err_f64 = (out.double().cpu() - want_f64).abs().max().item()
        err_ref = (out.float().cpu() - want_ref.float().cpu()).abs().max().item()
        assert err_f64 <= TOL_F64[self.dtype], f"max error {err_f64:.2e} against float64"
        assert err_ref <= TOL_REF[self.dtype], f"max error {err_ref:.2e} against the reference"


# (ctx_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, run kwargs)
CASES = {
    # Decodes: a first token, a block boundary, a context over several BLOCK_N tiles; GQA 1.
    "decode_gqa1": ([0, 16, 37, 150], [1, 1, 1, 1], 4, 4, 64, 16, {}),
    # Prefills from scratch, several wide query tiles; GQA 4.
    "prefill_gqa4": ([0, 0], [5, 70], 8, 2, 64, 16, {}),
    # Decodes and prefill chunks over cached prefixes, one sequence without new tokens; GQA 3.
    "mixed_gqa3": ([40, 70, 0, 15, 33], [1, 20, 9, 1, 0], 6, 2, 128, 32, {}),
    # Speculative-style short queries; GQA 8 (one kv head).
    "short_gqa8": ([30, 90], [2, 1], 8, 1, 64, 16, {}),
    # Few decodes over long contexts: the heuristic picks split-KV.
    "split_auto": ([300, 200, 5], [1, 1, 1], 8, 2, 64, 16, {}),
    # Split-KV forced on a mixed batch: empty segments, multi-token tiles.
    "split_mixed": ([40, 70, 0, 15], [1, 12, 5, 3], 6, 2, 128, 32, {"num_kv_splits": 4}),
    # Head dim that is not a power of two (padded), block size 8.
    "head_dim_40": ([20, 50], [1, 30], 4, 2, 40, 8, {}),
    # A long chunk over a long cached prefix, big blocks.
    "chunk_gqa4": ([120], [40], 4, 1, 64, 32, {}),
    # Queries on both sides of key-tile edges (BLOCK_N 16 and 64); head dim 32.
    "tile_edges": ([14, 15, 62, 63, 125], [1, 1, 1, 2, 3], 2, 1, 32, 16, {}),
    # SmolLM2's heads: decodes of many lengths (a first token among them) around a prefill.
    "smollm2_mixed": ([37, 200, 0, 64, 130, 15, 0], [1, 1, 1, 17, 1, 1, 6], 9, 3, 64, 16, {}),
    # A speculative verification step with k = 4: each decode verifies up to 4 proposals (query
    # lengths 1 + p), across block edges, beside plain decodes.
    "verify_k4": ([14, 31, 100, 0, 47, 63], [5, 5, 3, 5, 1, 2], 9, 3, 64, 16, {}),
}


@pytest.mark.parametrize("backend", ["triton", "cpu", "cpu-torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention(case, dtype, backend):
    ctx_lens, q_lens, hq, hkv, d, bs, kwargs = CASES[case]
    batch = Batch(ctx_lens, q_lens, hq, hkv, d, bs, dtype, seed=list(CASES).index(case))
    if backend == "triton":
        batch.check(batch.run(**kwargs))
    else:
        batch.check(batch.run_cpu(kernels=False if backend == "cpu-torch" else None))


def test_split_auto_really_splits():
    for dtype in DTYPES:
        cfg = ta.choose_config(8, 2, 64, dtype, 3, 301, 1, ta._num_sms(torch.device(DEVICE)))
        assert cfg.num_segments > 1


@pytest.mark.parametrize("config", [
    ta.AttentionConfig(128, 32, 64, 1, 8, 2),     # wide prefill tile in float32
    ta.AttentionConfig(16, 4, 32, 1, 4, 3),       # narrow tile for a prefill
    ta.AttentionConfig(32, 8, 16, 4, 4, 3),       # narrow tile, split
], ids=["wide", "narrow", "narrow_split"])
def test_forced_configs(config):
    batch = Batch([40, 0, 100], [1, 17, 6], 8, 2, 64, 16, torch.float32, seed=3)
    batch.check(batch.run(config=config))


def test_without_hints_and_with_wrong_hints():
    """Hints steer only tiling: missing or wrong hints still give the right answer."""
    batch = Batch([50, 10], [1, 30], 4, 2, 64, 16, torch.float32, seed=4)
    batch.check(batch.run(max_seq_len=None, max_query_len=None))
    batch.check(batch.run(max_seq_len=1, max_query_len=1))          # decode tiles for a prefill
    batch.check(batch.run(max_seq_len=10**6, max_query_len=10**4))


def test_no_host_sync_with_hints(monkeypatch):
    """With both hints the call reads no tensor value on the host (CUDA-graph safe)."""
    batch = Batch([60, 5], [1, 12], 4, 2, 64, 16, torch.float32, seed=5)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("paged_attention read a tensor value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = batch.run()
    monkeypatch.undo()
    batch.check(out)


def test_rows_past_the_batch_are_left_alone():
    batch = Batch([20], [3], 2, 1, 64, 16, torch.float32, seed=6)
    q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:], device=DEVICE)])
    out = torch.full_like(q, 7.0)
    ta.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                       batch.query_start_loc, batch.scale, max_seq_len=23, max_query_len=3,
                       out=out, num_kv_splits=2)
    batch.check(out[:3])
    assert (out[3:] == 7.0).all()


def test_empty_batch():
    q = torch.randn(0, 4, 64, device=DEVICE)
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = ta.paged_attention(q, cache, cache, tables, seq_lens, qsl, 0.1)
    assert out.shape == q.shape


def test_choose_num_segments():
    sms = 132                                      # an H100/H200
    assert ta.choose_num_segments(1, 8, 16384, 64, sms) == ta.MAX_SEGMENTS
    assert ta.choose_num_segments(32, 8, 4096, 64, sms) == 4
    assert ta.choose_num_segments(128, 8, 4096, 64, sms) == 1      # grid already full
    assert ta.choose_num_segments(1, 8, 100, 64, sms) == 1          # too short to split
    assert ta.choose_num_segments(1, 8, 512, 64, sms) == 4          # capped by length
    for seqs in (1, 3, 8, 17, 64):
        for ctx in (1, 100, 1000, 30000):
            n = ta.choose_num_segments(seqs, 8, ctx, 64, sms)
            assert n >= 1 and n & (n - 1) == 0 and n <= ta.MAX_SEGMENTS
            assert n == 1 or -(-ctx // 64) >= n * ta.MIN_TILES_PER_SEGMENT


def test_choose_config():
    decode = ta.choose_config(32, 8, 128, torch.bfloat16, 32, 4096, 1, 132)
    assert (decode.block_m, decode.block_q, decode.num_segments) == (16, 4, 4)
    prefill = ta.choose_config(32, 8, 128, torch.bfloat16, 32, 4096, 512, 132)
    assert (prefill.block_m, prefill.block_q, prefill.num_segments) == (128, 32, 1)
    gqa3 = ta.choose_config(24, 8, 128, torch.float16, 4, 100, 5, 132)
    assert gqa3.block_q == 16 // 3 and gqa3.block_m == 16
    big_group = ta.choose_config(64, 1, 64, torch.bfloat16, 1, 100, 1, 132)
    assert big_group.block_m == 64 and big_group.block_q == 1
    with pytest.raises(ValueError):
        ta.choose_config(8, 2, 64, torch.float16, 1, 100, 1, 132, num_kv_splits=3)


# ---------------------------------------------------------------------------------------------
# KV write


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, hkv, d, n = 7, 2, 64, 40
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    # Key and value as strided views of one fused projection, in float32 (converted on write).
    kv = torch.randn(n, 2, hkv, d + 8, generator=gen).to(DEVICE)
    key, value = kv[:, 0, :, :d], kv[:, 1, :, :d]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::5] = -1                                                  # skipped tokens
    slots = slots.to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    ta.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_write_kv_odd_heads_and_int32_slots():
    hkv, d, bs = 3, 40, 8
    k_cache = torch.zeros(5, bs, hkv, d, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(6, hkv, d, device=DEVICE).half()
    value = torch.randn(6, hkv, d, device=DEVICE).half()
    slots = torch.tensor([39, 0, -1, 8, 17, 7], dtype=torch.int32, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots.long())
    ta.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_int64_offsets_in_a_cache_past_2_31_elements():
    """Block ids near the end of a cache with more than 2**31 elements.

    The caches are 4 GiB of float16 each, but only a few blocks are ever touched: on the CPU
    torch.empty maps untouched pages lazily, so the test stays below 0.5 GB of real memory.
    Int32 offset arithmetic in either kernel would address memory outside the cache, which
    may crash the process, so the check runs in a child process.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.unit.kernels.test_kernels import _int64_offsets_check as check; check()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, (f"exit {proc.returncode}\n" + proc.stdout[-3000:]
                                  + proc.stderr[-3000:])


def _int64_offsets_check():
    torch.set_num_threads(1)
    bs, hkv, d = 16, 8, 128
    per_block = bs * hkv * d                                         # 2**14 elements
    num_blocks = 2 ** 31 // per_block + 8
    try:
        k_cache = torch.empty(num_blocks, bs, hkv, d, dtype=torch.float16, device=DEVICE)
        v_cache = torch.empty_like(k_cache)
    except (RuntimeError, MemoryError) as exc:
        print(f"cannot map two 4 GiB caches here: {exc}")
        sys.exit(77)
    gen = torch.Generator().manual_seed(7)
    near_end = [num_blocks - 1, num_blocks - 3, 2 ** 31 // per_block - 1, 5, num_blocks - 2]
    for b in near_end + [num_blocks - 4]:                            # touch, with known values
        k_cache[b] = torch.randn(bs, hkv, d, generator=gen).half().to(DEVICE)
        v_cache[b] = torch.randn(bs, hkv, d, generator=gen).half().to(DEVICE)
    before_k = {b: k_cache[b].clone() for b in near_end + [num_blocks - 4]}
    before_v = {b: v_cache[b].clone() for b in near_end + [num_blocks - 4]}

    # One sequence of 70 tokens over blocks near_end (5 blocks = 80 slots), written in two steps.
    seq_blocks = torch.tensor(near_end, dtype=torch.int32)
    positions = torch.arange(70)
    slots = (seq_blocks[positions // bs].long() * bs + positions % bs).to(DEVICE)
    key = torch.randn(70, hkv, d, generator=gen).half().to(DEVICE)
    value = torch.randn(70, hkv, d, generator=gen).half().to(DEVICE)
    slots_skip = slots.clone()
    slots_skip[-3:] = -1
    ta.write_kv(key, value, k_cache, v_cache, slots_skip)
    for i in range(67):
        b, o = int(seq_blocks[i // bs]), i % bs
        assert torch.equal(k_cache[b, o], key[i]) and torch.equal(v_cache[b, o], value[i]), i
    for i in range(67, 80):                                           # skipped or never written
        b, o = int(seq_blocks[i // bs]), i % bs
        assert torch.equal(k_cache[b, o], before_k[b][o])
        assert torch.equal(v_cache[b, o], before_v[b][o])
    assert torch.equal(k_cache[num_blocks - 4], before_k[num_blocks - 4])
    ta.write_kv(key[67:], value[67:], k_cache, v_cache, slots[67:])

    # Attention over those blocks: a decode and a 4-token chunk in the same batch.
    tables = seq_blocks[None].repeat(2, 1).to(DEVICE)
    tables[1] = torch.tensor([num_blocks - 2, 5, num_blocks - 1, 0, 0], dtype=torch.int32)
    seq_lens = torch.tensor([70, 40], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 5], dtype=torch.int32, device=DEVICE)
    q = torch.randn(5, 4 * hkv, d, generator=gen).half().to(DEVICE)
    # The float64 check reads a compact copy of the blocks in use (the caches stay where they are).
    used = sorted(set(near_end))
    compact = torch.tensor([[used.index(b) if b in used else 0 for b in row]
                            for row in tables.tolist()], dtype=torch.int32)
    want = ref.paged_attention_float64(q.cpu(), k_cache[used].cpu(), v_cache[used].cpu(), compact,
                                       seq_lens.cpu(), qsl.cpu(), d ** -0.5)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        ta.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, d ** -0.5, max_seq_len=70,
                           max_query_len=4, out=out, num_kv_splits=splits)
        assert (out.double().cpu() - want).abs().max().item() <= TOL_F64[torch.float16]
    del k_cache, v_cache


def test_kernels_compile_for_hopper_without_spills():
    """Cross-compiles the GPU variants for sm_90 (no GPU needed) and checks registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.bench_attention",
                           "--compile-check", "quick"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
