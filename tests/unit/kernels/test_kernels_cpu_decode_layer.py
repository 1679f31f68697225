"""kernels/csrc/cpu_decode_layer.c (a whole decode step in one call) against its float64 reference on
the dequantized (or widened) weights, on every instruction set this CPU has (the test names
them): Q4_1, Q8_0, fp32 and bf16 weights, fp32 and bf16 caches, one token of each of several
sequences and a verification's several tokens of one, on a cache poisoned with NaN wherever no
sequence has a position."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_attention, cpu_decode_attention, cpu_decode_layer
from pagoda.kernels.cpu_decode_layer import Shape
from worker.model.layers import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

# A head dim of 32: the smallest a bf16 cache attends in groups (kernels/csrc/cpu_decode_attention.c).
SHAPE = dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=96, eps=1e-5)
LAYERS, NUM_BLOCKS = 3, 24
# Steps: (context before the step's tokens, new tokens) per sequence, and the block size.
STEPS = {
    "three_sequences": ([(0, 1), (17, 1), (40, 1)], 16),
    "verification_of_4": ([(23, 5)], 16),
    "mixed_block_5": ([(9, 1), (3, 4)], 5),
    # 17 rows: the AVX2 projections' weight panels (kernels/csrc/cpu_weight_panel.h), from 12 on
    "batch_of_17": ([(7 * i % 15, 1) for i in range(17)], 16),
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _model(kind: str, g: torch.Generator):
    s = SHAPE
    qkv_rows = (s["num_heads"] + 2 * s["num_kv_heads"]) * s["head_dim"]

    def w(n, k):
        return torch.randn(n, k, generator=g) * k ** -0.5

    def norm():
        return 1 + 0.1 * torch.randn(s["hidden"], generator=g)
    weights = [cpu_decode_layer.layer_weights(
        [w(qkv_rows, s["hidden"]), w(s["hidden"], s["num_heads"] * s["head_dim"]),
         w(2 * s["intermediate"], s["hidden"]), w(s["hidden"], s["intermediate"])], norm(), norm(), kind)
        for _ in range(LAYERS)]
    return weights, norm()


def _step(seqs, bs, dtype, g):
    """Caches with every sequence's context filled in (and NaN elsewhere), and the step's tokens
    as decode rows: positions, slots, lens, tables (block j of a sequence at a scattered block)."""
    s = SHAPE
    shape = (NUM_BLOCKS, bs, s["num_kv_heads"], s["head_dim"])
    caches = [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
              for _ in range(LAYERS)]
    order = torch.randperm(NUM_BLOCKS, generator=g)
    positions, slots, lens, tables, used = [], [], [], [], 0
    width = max(-(-(ctx + n) // bs) for ctx, n in seqs)
    for ctx, n in seqs:
        blocks = order[used:used + -(-(ctx + n) // bs)]
        used += blocks.numel()
        table = torch.cat([blocks, order[-1:].repeat(width - blocks.numel())])  # padding: a NaN block
        for k_cache, v_cache in caches:
            keys = cpu_attention.key_blocks(k_cache)
            for pos in range(ctx):
                b, o = int(blocks[pos // bs]), pos % bs
                keys[b, :, :, o] = torch.randn(s["num_kv_heads"], s["head_dim"], generator=g).to(dtype)
                v_cache[b, o] = torch.randn(s["num_kv_heads"], s["head_dim"], generator=g).to(dtype)
        for i in range(n):
            positions.append(ctx + i)
            slots.append(int(blocks[(ctx + i) // bs]) * bs + (ctx + i) % bs)
            lens.append(ctx + i + 1)
            tables.append(table)
    assert used < NUM_BLOCKS  # the last block stays NaN
    return (caches, torch.tensor(positions), torch.tensor(slots), torch.tensor(lens, dtype=torch.int32),
            torch.stack(tables).to(torch.int32))


BF16_PRODUCTS = {0: "widened", 1: "AVX512-BF16 dots", 2: "AMX tiles"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "int8", "f32", "bf16"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_decode_step_equals_float64_on_every_isa_here(step, kind, dtype):
    if not cpu_decode_layer.available():
        pytest.skip(f"no decode layer kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    g = torch.Generator().manual_seed(list(STEPS).index(step))
    weights, final_norm = _model(kind, g)
    seqs, bs = STEPS[step]
    caches, positions, slots, lens, tables = _step(seqs, bs, dtype, g)
    shape = Shape(**SHAPE, kind=kind)
    T = positions.numel()
    h = torch.randn(T, SHAPE["hidden"], generator=g)
    cis = RotaryEmbedding(SHAPE["head_dim"], 128, 10000.0).cis
    dots = cpu_decode_layer.bf16_modes_here() if kind == "bf16" else [0]  # widened, dot products, AMX
    isas = cpu_decode_layer.supported_isas()
    print(f"decode layer paths here: {[cpu_decode_layer.ISA_NAMES[i] for i in isas]}, "
          f"bf16 products {[BF16_PRODUCTS[d] for d in dots]}")
    for isa, dot in [(isa, dot) for isa in isas for dot in dots if isa == 2 or not dot]:
        ref_caches = [(k.clone(), v.clone()) for k, v in caches]
        want = cpu_decode_layer.reference(weights, shape, final_norm, h, cis, positions, slots, ref_caches,
                                          lens, tables, bf16_dot=dot)
        run_caches = [(k.clone(), v.clone()) for k, v in caches]
        layers = cpu_decode_layer.layers_array(weights, run_caches)
        stream = h.clone()
        got = cpu_decode_layer.decode_step(layers, shape, final_norm, stream, cis, positions, slots,
                                           torch.arange(T, dtype=torch.int32), lens, tables,
                                           run_caches[0][0], isa=isa, bf16_dot=dot)
        name = (cpu_decode_layer.ISA_NAMES[isa], f"bf16 products {BF16_PRODUCTS[dot]}")
        assert not got.isnan().any(), name
        err = ((got.double() - want).abs() / want.abs().clamp(min=1)).max().item()
        assert err <= (max(TOL[dtype], cpu_decode_layer.BF16_DOT_TOL) if dot else TOL[dtype]), (name, err)
        for (k, v), (k_ref, v_ref) in zip(run_caches, ref_caches):  # the step's K/V, and nothing else
            assert torch.equal(k.isnan(), k_ref.isnan()) and torch.equal(v.isnan(), v_ref.isnan()), name
            for got_cache, want_cache in ((k, k_ref), (v, v_ref)):
                held = ~want_cache.isnan()
                err = (got_cache[held].double() - want_cache[held].double()).abs().max().item()
                # with bf16 dot products a later layer's K/V inherit the earlier layers' roundings
                # (an activation a hair either side of a bf16 boundary): the output's tolerance
                assert err <= (max(4 * TOL[dtype], cpu_decode_layer.BF16_DOT_TOL) if dot else 4 * TOL[dtype]), (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_steps_attention_prefetch_setting_changes_no_number(monkeypatch, dtype):
    """The one-call step passes cpu_decode_attention.prefetch to its attention: off and on, the
    same stream and caches, bit for bit (the float64 test above runs it on)."""
    if not cpu_decode_layer.available():
        pytest.skip(f"no decode layer kernel on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    g = torch.Generator().manual_seed(7)
    weights, final_norm = _model("f32", g)
    seqs, bs = max(STEPS.values(), key=lambda s: len(s[0]))
    caches, positions, slots, lens, tables = _step(seqs, bs, dtype, g)
    T = positions.numel()
    h = torch.randn(T, SHAPE["hidden"], generator=g)
    cis = RotaryEmbedding(SHAPE["head_dim"], 128, 10000.0).cis
    results = []
    for ahead in (False, True):
        monkeypatch.setattr(cpu_decode_attention, "prefetch", ahead)
        run_caches = [(k.clone(), v.clone()) for k, v in caches]
        layers = cpu_decode_layer.layers_array(weights, run_caches)
        got = cpu_decode_layer.decode_step(layers, Shape(**SHAPE, kind="f32"), final_norm, h.clone(), cis,
                                           positions, slots, torch.arange(T, dtype=torch.int32), lens, tables,
                                           run_caches[0][0])
        results.append((got, run_caches))
    (a, caches_a), (b, caches_b) = results
    assert not a.isnan().any() and torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka.nan_to_num(), kb.nan_to_num()) and torch.equal(va.nan_to_num(), vb.nan_to_num())


def test_the_stream_is_summed_in_place_and_a_negative_slot_is_not_written():
    if not cpu_decode_layer.available():
        pytest.skip("no decode layer kernel on this CPU")
    g = torch.Generator().manual_seed(7)
    weights, final_norm = _model("q4_1", g)
    caches, positions, slots, lens, tables = _step([(12, 1)], 16, torch.float32, g)
    before = [(k.clone(), v.clone()) for k, v in caches]
    # The token still attends over its own position, which keeps what the cache held there.
    slot = int(slots[0])
    for k, v in caches:
        cpu_attention.key_blocks(k)[slot // 16, :, :, slot % 16] = 0.5
        v.view(-1, *v.shape[2:])[slot] = 0.25
    before = [(k.clone(), v.clone()) for k, v in caches]
    h = torch.randn(1, SHAPE["hidden"], generator=g)
    stream = h.clone()
    shape = Shape(**SHAPE, kind="q4_1")
    cis = RotaryEmbedding(SHAPE["head_dim"], 128, 10000.0).cis
    out = cpu_decode_layer.decode_step(cpu_decode_layer.layers_array(weights, caches), shape, final_norm,
                                       stream, cis, positions, torch.tensor([-1]), torch.tensor([0], dtype=torch.int32),
                                       lens, tables, caches[0][0])
    for (k, v), (k0, v0) in zip(caches, before):
        assert torch.equal(k.nan_to_num(7), k0.nan_to_num(7)) and torch.equal(v.nan_to_num(7), v0.nan_to_num(7))
    assert not torch.equal(stream, h)  # the residual stream, summed in place
    want = stream * torch.rsqrt(stream.double().pow(2).mean(-1, keepdim=True) + 1e-5).float() * final_norm
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
