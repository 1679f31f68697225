"""CUDA only: graph capture, host syncs and a speed floor for the Triton attention kernels (the
correctness tests, bfloat16 included, are in tests/unit/kernels/test_kernels.py and run here too)."""
from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    import triton

    from pagoda.kernels import triton_attention as ta
    from tests.unit.kernels.test_kernels import Batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("q_lens,max_query_len", [([1, 16, 1], 16), ([1, 1, 1], 1)],
                         ids=["mixed", "decode_split"])
def test_cuda_graph_capture_and_replay(q_lens, max_query_len):
    """Captured with host hints only (the decode batch takes the split-KV path), replayed on new
    queries."""
    batch = Batch([100, 0, 500], q_lens, 32, 8, 128, 16, torch.bfloat16, seed=8)
    out = torch.empty_like(batch.q)

    def call():
        ta.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                           batch.seq_lens, batch.query_start_loc, batch.scale,
                           max_seq_len=4096, max_query_len=max_query_len, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()                                                       # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    batch.q.copy_(torch.randn_like(batch.q))                          # new data, same buffers
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    batch.check(out)


@needs_cuda
def test_no_device_sync_with_hints():
    batch = Batch([100, 0, 300], [1, 16, 1], 8, 2, 128, 16, torch.bfloat16, seed=9)
    batch.run()                                                      # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = batch.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    batch.check(out)


def _copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


@needs_cuda
def test_decode_speed_sanity():
    """A loose floor (the benchmark reports the real figure): decode reads its KV at >= 25% of
    the copy bandwidth. It catches a serialised grid or a spilling kernel, not small losses."""
    b, ctx, hq, hkv, d, bs = 32, 4096, 32, 8, 128, 16
    num_blocks = b * ctx // bs
    k_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").view(b, -1).int()
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: ta.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, qsl, d ** -0.5, max_seq_len=ctx, max_query_len=1))
    bandwidth = 2 * k_cache.numel() * k_cache.element_size() / (ms * 1e-3)
    assert bandwidth >= 0.25 * _copy_bandwidth(1 << 30)
