"""The CPU attention backend's own layout and step plan (kernels/cpu_attention.py); its results
against the reference and float64 run with every case in tests/unit/kernels/test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from tests.unit.kernels.test_kernels import TOL_F64, Batch, cpu, ref


def test_cpu_rows_past_the_batch_are_left_alone_and_the_plan_serves_every_layer():
    batch = Batch([20, 9], [3, 1], 6, 2, 64, 16, torch.float32, seed=6)
    plan = cpu.plan_attention(batch.block_tables.cpu(), batch.seq_lens.cpu(),
                              batch.query_start_loc.cpu(), batch.clean_k.cpu(), 6)
    q = torch.cat([batch.q.cpu(), torch.randn(2, 6, 64)])
    for layer in range(2):                                           # other caches, same plan
        k_cache, v_cache = batch.clean_k.cpu() * (layer + 1), batch.clean_v.cpu() - layer
        out = torch.full_like(q, 7.0)
        cpu.paged_attention(q, k_cache, v_cache, plan, batch.scale, out=out)
        want = ref.paged_attention_float64(batch.q.cpu(), cpu.key_blocks(k_cache).permute(0, 3, 1, 2),
                                           v_cache, batch.clean_tables.cpu(), batch.seq_lens.cpu(),
                                           batch.query_start_loc.cpu(), batch.scale)
        assert (out[:4].double() - want).abs().max() <= TOL_F64[torch.float32]
        assert (out[4:] == 7.0).all()


def _slots(kind: str, num_slots: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Scattered slots, or a prefill's runs: consecutive slots from mid-block across block ends."""
    if kind == "scattered":
        return torch.randperm(num_slots, generator=gen)[:n]
    return torch.cat([torch.arange(5, 5 + n // 2), torch.arange(num_slots - 1 - (n - n // 2), num_slots - 1)])


@pytest.mark.parametrize("slots_kind", ["scattered", "runs"])
@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_write_kv_keeps_keys_transposed_within_blocks(dtype, path, slots_kind):
    from pagoda.kernels import cpu_decode_attention
    if path == "c" and not cpu_decode_attention.available():
        pytest.skip("no C kernel on this CPU")
    gen = torch.Generator().manual_seed(3)
    num_blocks, bs, hkv, d, n = 6, 16, 3, 64, 40
    want_k = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    want_v = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    k_cache, v_cache = torch.empty_like(want_k), want_v.clone()
    cpu.key_blocks(k_cache).copy_(want_k.permute(0, 2, 3, 1))
    kv = torch.randn(n, 2, hkv, d + 8, generator=gen)              # strided float32 views
    key, value = kv[:, 0, :, :d], kv[:, 1, :, :d]
    slots = _slots(slots_kind, num_blocks * bs, n, gen)
    slots[::7] = -1                                                  # skipped tokens
    ref.write_kv(key, value, want_k, want_v, slots)
    cpu.write_kv(key, value, k_cache, v_cache, slots, kernel=path == "c")
    assert torch.equal(v_cache, want_v)
    assert torch.equal(cpu.key_blocks(k_cache), want_k.permute(0, 2, 3, 1))


@pytest.mark.parametrize("ctx", [0, 24], ids=["causal", "with-cache"])
def test_cpu_prefill_runs_torch_flash_kernel(ctx):
    """Where kernels/csrc/cpu_prefill_attention.c does not run, a prefill chunk's SDPA takes torch's
    CPU flash kernel, not the unfused math path (3-4x slower at a few hundred tokens): torch
    picks it only for 4-D inputs."""
    batch = Batch([ctx], [40], 6, 2, 64, 16, torch.float32, seed=7)
    k_cache, v_cache = torch.empty_like(batch.clean_k.cpu()), batch.clean_v.cpu()
    cpu.key_blocks(k_cache).copy_(batch.clean_k.cpu().permute(0, 2, 3, 1))
    plan = cpu.plan_attention(batch.block_tables.cpu(), batch.seq_lens.cpu(),
                              batch.query_start_loc.cpu(), k_cache, 6, prefill_kernel=False)
    with torch.profiler.profile() as prof:
        cpu.paged_attention(batch.q.cpu(), k_cache, v_cache, plan, batch.scale)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
