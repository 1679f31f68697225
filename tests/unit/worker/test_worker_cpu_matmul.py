"""worker/model/cpu_matmul.py: which path CPU projections take is measured once per machine and kept;
the measurement races the very products each path would compute; --cpu-matmul torch turns both
kernels off (a kernel that disagrees with float64 is off: tests/unit/kernels/test_kernels_startup_checks.py)."""
from __future__ import annotations

import json

import pytest
import torch

import worker.model.layers as layers
from pagoda.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8
from worker.model import cpu_matmul
from worker.model.cpu_matmul import BF16_ROWS, FP32_ROWS, WIDEN_ROWS, CpuMatmul

SHAPE = (96, 40)
BF16 = torch.bfloat16


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path / "cache"))
    return tmp_path / "cache" / f"{cpu_matmul.CACHE_NAME}.json"


@pytest.fixture
def measured(monkeypatch):
    """measure() replaced by a recorder returning a fixed choice."""
    calls = []
    choice = CpuMatmul(256, 8, True)
    monkeypatch.setattr(cpu_matmul, "measure", lambda fp32, bf16, shape: calls.append(shape) or choice)
    monkeypatch.setattr(cpu_gemm, "available", lambda: True)
    monkeypatch.setattr(cpu_gemm_bf16, "available", lambda: True)
    return calls, choice


def test_the_bound_is_the_prefix_of_row_counts_that_saves_the_most():
    def ratios(table):
        return lambda m: table[m]

    rows = (16, 64, 128, 256, 512, 1024)
    assert cpu_matmul.bound(rows, ratios(dict(zip(rows, (0.5, 0.7, 0.9, 1.1, 1.3, 1.5))))) == 128
    # One noisy tie or small loss among wins does not hand the larger products to BLAS.
    assert cpu_matmul.bound(rows, ratios(dict(zip(rows, (0.5, 1.05, 0.8, 0.9, 0.95, 1.2))))) == 512
    assert cpu_matmul.bound(rows, ratios(dict(zip(rows, (0.5, 0.6, 0.7, 0.8, 0.9, 0.95))))) == 1024
    assert cpu_matmul.bound(rows, ratios(dict(zip(rows, (1.2, 1.1, 0.95, 1.3, 1.4, 1.5))))) == 0
    # A win far out does not pay for the losses before it.
    assert cpu_matmul.bound(rows, ratios(dict(zip(rows, (0.9, 1.3, 1.3, 0.8, 1.2, 1.2))))) == 16


def test_a_kernel_that_wins_at_the_last_count_takes_every_larger_product_where_asked():
    """beyond: a win at the largest count timed stands for every larger product (both paths are
    bound by arithmetic there), so a 2048-token prefill chunk is not handed to the slower BLAS."""
    rows = (16, 64, 128, 256, 512, 1024)
    wins = dict(zip(rows, (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)))
    assert cpu_matmul.bound(rows, wins.get, beyond=True) == cpu_matmul.ALL_ROWS
    assert cpu_matmul.bound(rows, wins.get) == 1024
    # A loss at the last count keeps the bound where the saving peaked.
    assert cpu_matmul.bound(rows, dict(zip(rows, (0.5, 0.6, 0.7, 0.8, 0.9, 1.05))).get, beyond=True) == 512
    # A tie among wins up to the last still counts as winning there.
    assert cpu_matmul.bound(rows, dict(zip(rows, (0.5, 0.6, 1.05, 0.8, 0.9, 0.95))).get, beyond=True) \
        == cpu_matmul.ALL_ROWS


@pytest.mark.skipif(not cpu_gemm.available(), reason="no fp32 kernel on this CPU")
def test_with_every_row_count_the_kernel_takes_products_larger_than_any_timed(monkeypatch):
    calls = []
    real = cpu_gemm.xwt
    monkeypatch.setattr(layers, "CPU", CpuMatmul(cpu_matmul.ALL_ROWS))
    monkeypatch.setattr(cpu_gemm, "xwt", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    x, w = torch.randn(2 * max(FP32_ROWS), 64), torch.randn(48, 64)
    torch.testing.assert_close(layers.linear(x, w).double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-4)
    assert calls == [2 * max(FP32_ROWS)]


def test_the_ratio_is_the_median_of_pairs_timed_back_to_back_on_weights_apart(monkeypatch):
    """Each pair: the kernel on one weight, then the other path on the weight half the pool away;
    every weight of the pool for few rows, a share of it for many; a median, so one slow pair
    (the VM's neighbour) does not move it."""
    pool = [torch.full((4, 8), float(i)) for i in range(8)]
    seen, clock = [], [0.0]

    def timed(name, cost):
        def fn(x, w):
            seen.append((name, int(w[0, 0]), x.shape[0]))
            clock[0] += cost * (50 if len(seen) == 9 else 1)  # one pair 50 times slower
        return fn

    monkeypatch.setattr(cpu_matmul.time, "perf_counter", lambda: clock[0])
    few = cpu_matmul.ratio(timed("k", 1.0), timed("o", 2.0), torch.zeros(3, 8), pool, pairs=12)
    assert few == pytest.approx(0.5)
    timed_calls = seen[2:]  # after the warm-up pair
    assert [(a[1], b[1]) for a, b in zip(timed_calls[::2], timed_calls[1::2])] == \
        [(i, (i + 4) % 8) for i in range(8)] * 2  # 16 pairs: the pool twice, at least 12
    seen.clear()
    cpu_matmul.ratio(timed("k", 1.0), timed("o", 2.0), torch.zeros(4 * cpu_matmul.STREAM_ROWS, 8), pool)
    assert {w for _, w, _ in seen} == {0, 1}  # a quarter of the pool for 4x the streaming rows


def test_a_measurement_is_kept_and_read_back_by_the_next_start(cache, measured):
    calls, choice = measured
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and calls == [SHAPE]
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and calls == [SHAPE]  # read, not measured
    (entry,) = json.loads(cache.read_text()).values()
    assert entry == {"fp32_kernel_rows": 256, "bf16_kernel_rows": 8, "bf16_widen": True, "bf16_few_rows_tiles": False}
    # Another shape, or another thread count, is another measurement.
    cpu_matmul.choose(True, (SHAPE[0] * 2, SHAPE[1]), BF16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cpu_matmul.choose(True, SHAPE, BF16)
    finally:
        torch.set_num_threads(threads)
    assert calls == [SHAPE, (SHAPE[0] * 2, SHAPE[1]), SHAPE]
    assert len(json.loads(cache.read_text())) == 3


def test_measure_again_measures_whatever_was_kept_and_keeps_the_new_bounds(cache, measured, monkeypatch):
    calls, choice = measured
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and calls == [SHAPE]
    again = CpuMatmul(64, 4, False)  # what a quieter machine measures
    monkeypatch.setattr(cpu_matmul, "measure", lambda fp32, bf16, shape: calls.append(shape) or again)
    assert layers.use_cpu_kernel(True, SHAPE, BF16, again=True) == again == layers.CPU
    assert calls == [SHAPE, SHAPE]
    assert cpu_matmul.choose(True, SHAPE, BF16) == again and calls == [SHAPE, SHAPE]  # kept, read back
    (entry,) = json.loads(cache.read_text()).values()
    assert entry == {"fp32_kernel_rows": 64, "bf16_kernel_rows": 4, "bf16_widen": False, "bf16_few_rows_tiles": False}


@pytest.mark.parametrize("content", ["{not json", '["a list"]', None], ids=["garbled", "not-a-dict", "old-fields"])
def test_a_cache_it_cannot_use_costs_a_measurement_not_a_start(cache, measured, content):
    calls, choice = measured
    cpu_matmul.choose(True, SHAPE, BF16)
    if content is None:  # an entry written by a version with other fields
        data = json.loads(cache.read_text())
        data = {k: {"old_rows": 1} for k in data}
        content = json.dumps(data)
    cache.write_text(content)
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and len(calls) == 2
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and len(calls) == 2  # rewritten


def test_an_unwritable_cache_still_gives_the_choice(tmp_path, monkeypatch, measured):
    calls, choice = measured
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(blocker))  # a file where the folder should be
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and len(calls) == 2


def test_the_flag_turns_both_kernels_off_without_measuring(cache, measured):
    calls, _ = measured
    assert layers.use_cpu_kernel(False, SHAPE, BF16) == CpuMatmul() == layers.CPU
    assert calls == [] and not cache.exists()


@pytest.mark.skipif(not cpu_gemm.available(), reason="no fp32 kernel on this CPU")
def test_with_the_flag_off_projections_go_through_torch(monkeypatch, cache):
    calls = []
    monkeypatch.setattr(layers, "CPU", layers.CPU)  # put back afterwards
    monkeypatch.setattr(cpu_gemm, "xwt", lambda *a: calls.append(a))
    layers.use_cpu_kernel(False, SHAPE, BF16)
    layers.linear(torch.randn(3, 8), torch.randn(4, 8))
    assert calls == []


def test_the_measurement_races_the_products_each_path_computes(monkeypatch):
    """measure() with a stand-in clock: every race compares two computations of the same
    product (within float32 / bf16 rounding of each other), at every row count the bounds need."""
    if not (cpu_gemm.available() and cpu_gemm_bf16.available()):
        pytest.skip("needs both kernels")
    raced = []

    def ratio(kernel, other, x, pool, pairs=cpu_matmul.PAIRS):
        a, b = kernel(x, pool[0]), other(x, pool[-1] if len(pool) == 1 else pool[0])
        assert a.shape == b.shape == (x.shape[0], SHAPE[0]) and a.dtype == b.dtype == x.dtype
        tol = 1e-4 if a.dtype == torch.float32 else 2.0 ** -6
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * 10)
        raced.append((a.dtype, x.shape[0]))
        if x.shape[0] == WIDEN_ROWS and a.dtype == BF16:
            return 0.2  # widening wins
        return 0.5 if x.shape[0] <= (512 if a.dtype == torch.float32 else 4) else 2.0

    monkeypatch.setattr(cpu_matmul, "ratio", ratio)
    tiles = max(cpu_gemm_bf16.supported_isas()) >= 2  # one row in the 4 x 4 tiles against one at a time
    assert cpu_matmul.measure(True, True, SHAPE) == CpuMatmul(512, 4, True, tiles)
    assert raced == ([(torch.float32, m) for m in FP32_ROWS] + [(BF16, WIDEN_ROWS)] + [(BF16, 1)] * tiles
                     + [(BF16, m) for m in BF16_ROWS])
    raced.clear()
    assert cpu_matmul.measure(True, False, SHAPE) == CpuMatmul(512, 0, False)
    assert raced == [(torch.float32, m) for m in FP32_ROWS]


def test_an_fp32_model_measures_no_bf16_bound(cache, monkeypatch):
    if not (cpu_gemm.available() and cpu_gemm_bf16.available()):
        pytest.skip("needs both kernels")
    asked = []
    monkeypatch.setattr(cpu_matmul, "measure", lambda fp32, bf16, shape: asked.append((fp32, bf16))
                        or CpuMatmul(64 * fp32, 8 * bf16, bf16))
    assert cpu_matmul.choose(True, SHAPE, torch.float32) == CpuMatmul(64, 0, False)
    assert cpu_matmul.choose(True, SHAPE, BF16) == CpuMatmul(64, 8, True)
    assert asked == [(True, False), (True, True)]


def test_workers_starting_together_measure_once(cache, measured, monkeypatch):
    """Two at once: the second waits for the first's measurement and reads it (two measuring
    together on two cores would time each other)."""
    import threading
    import time
    calls, choice = measured
    inside = []

    def slow_measure(fp32, bf16, shape):
        inside.append(1)
        assert len(inside) == 1, "two measurements at once"
        time.sleep(0.3)
        inside.pop()
        calls.append(shape)
        return choice

    monkeypatch.setattr(cpu_matmul, "measure", slow_measure)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cpu_matmul.choose(True, SHAPE, BF16))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [choice, choice] and calls == [SHAPE]


QUANT_SHAPE = (96, 64)  # GGUF rows are whole blocks of 32
QUANT_LAYER = ((128, 64), (64, 64), (192, 64), (64, 96))  # a layer's q|k|v, o, gate|up, down
KINDS = ["int8", "q8_0", "q4_1"]


def _module(kind):
    return cpu_gemm_int8 if kind == "int8" else cpu_gemm_gguf


def _quantized(shape, kind):
    """A random weight in `kind`, its float64 dequantization and a layers.* projection by it."""
    w = torch.randn(*shape)
    if kind == "int8":
        w8, scale = cpu_gemm_int8.quantize(w)
        return (cpu_gemm_int8.dequantize(w8, scale, torch.float64),
                lambda x, **k: layers.int8_linear(x, w8, scale, **k))
    blocks = cpu_gemm_gguf.quantize(w, kind)
    return (cpu_gemm_gguf.dequantize(blocks, kind, torch.float64),
            lambda x, **k: layers.gguf_linear(x, blocks, kind, **k))


def _counting_kernel(monkeypatch, kind):
    """The rows of every call into kind's kernel."""
    module, rows = _module(kind), []
    real = module.xwt
    monkeypatch.setattr(module, "xwt", lambda *a, **k: rows.append(a[0].shape[0]) or real(*a, **k))
    return rows


def _keep_bounds(monkeypatch):
    for name in ("QUANTIZED_KERNEL_ROWS", "QUANTIZED_VOCAB_KERNEL_ROWS"):  # put back afterwards
        monkeypatch.setattr(layers, name, getattr(layers, name))


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_bound_races_the_kernel_against_the_dequantized_gemm_and_is_kept(cache, monkeypatch, kind):
    """Each race computes the same product both ways (the kernel's exact fp32 path against torch
    on the dequantized weights), at every count of QUANTIZED_ROWS; the bound is kept per kind and
    read back by the next start; --cpu-matmul torch keeps the default without measuring."""
    if not _module(kind).available():
        pytest.skip(f"no {kind} kernel on this CPU")
    raced, layer = [], [QUANT_LAYER]

    def ratio(kernel, other, x, pool, pairs=cpu_matmul.PAIRS):
        a, b = kernel(x, pool[0]), other(x, pool[0])  # every weight of the layer, in order
        assert [t.shape for t in a] == [t.shape for t in b] == [(x.shape[0], n) for n, _ in layer[0]]
        assert len(pool) > 1 and [tuple(w.shape) for w in _weights(pool[1])] == [tuple(w.shape) for w in _weights(pool[0])]
        for got, want in zip(a, b):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        raced.append(x.shape[0])
        return 0.5 if x.shape[0] <= 128 else 2.0

    monkeypatch.setattr(cpu_matmul, "ratio", ratio)
    assert cpu_matmul.choose_quantized(True, QUANT_LAYER, kind) == 128 and raced == list(cpu_matmul.QUANTIZED_ROWS)
    assert cpu_matmul.choose_quantized(True, QUANT_LAYER, kind) == 128 and len(raced) == len(cpu_matmul.QUANTIZED_ROWS)
    assert {"kernel_rows": 128} in json.loads(cache.read_text()).values()
    layer[0] = QUANT_LAYER[:2]
    cpu_matmul.choose_quantized(True, QUANT_LAYER[:2], kind)  # another layer is another race
    assert len(raced) == 2 * len(cpu_matmul.QUANTIZED_ROWS)
    assert cpu_matmul.choose_quantized(False, QUANT_LAYER, kind) == cpu_matmul.QUANTIZED_DEFAULT_ROWS
    assert len(raced) == 2 * len(cpu_matmul.QUANTIZED_ROWS)


def _weights(packed):
    """The tensors of a layer's packed weights (int8: rows and scales; GGUF: blocks)."""
    return [w[0] if isinstance(w, tuple) else w for w in packed]


@pytest.mark.parametrize("kind", KINDS)
def test_past_its_bound_a_quantized_projection_is_an_fp32_product_as_fp32_projections_are(cache, monkeypatch, kind):
    """Dequantized weights go through linear(): the fp32 kernel up to its bound (kernels/csrc/cpu_gemm.c
    outruns MKL on some machines at every size), BLAS past it; and the quantized race times that
    same path, under the fp32 bound it is given (kept apart from another fp32 bound's)."""
    if not (_module(kind).available() and cpu_gemm.available()):
        pytest.skip(f"no {kind} or fp32 kernel on this CPU")
    fp32_calls = []
    real = cpu_gemm.xwt
    monkeypatch.setattr(cpu_gemm, "xwt", lambda x, w: fp32_calls.append(x.shape[0]) or real(x, w))
    monkeypatch.setattr(layers, "CPU", CpuMatmul(8))
    _keep_bounds(monkeypatch)
    monkeypatch.setattr(cpu_matmul, "measure_quantized",
                        lambda shapes, kind, vocab=False, fp32_rows=0: fp32_calls.append(("raced", fp32_rows)) or 2)
    assert layers.use_quantized_kernel(True, (QUANT_SHAPE,), kind) == 2
    assert fp32_calls == [("raced", 8)]
    fp32_calls.clear()
    want_weight, project = _quantized(QUANT_SHAPE, kind)
    for rows in (2, 5, 9):
        x = torch.randn(rows, QUANT_SHAPE[1])
        torch.testing.assert_close(project(x).double(), x.double() @ want_weight.t(), rtol=1e-4, atol=1e-3)
    assert fp32_calls == [5]  # 2: the quantized kernel; 9: past the fp32 bound too, BLAS
    monkeypatch.undo()  # the real race, under two fp32 bounds: the dequantized side is linear()'s path
    seen = []
    monkeypatch.setattr(cpu_gemm, "xwt", lambda x, w: seen.append(x.shape[0]) or real(x, w))
    monkeypatch.setattr(cpu_matmul, "ratio", lambda kernel, other, x, pool, pairs=0: other(x, pool[0]) is None or 0.5)
    monkeypatch.setattr(cpu_matmul, "QUANTIZED_ROWS", (1, 16))
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(cache.parent))
    assert cpu_matmul.choose_quantized(True, (QUANT_SHAPE,), kind, fp32_rows=8) == cpu_matmul.ALL_ROWS
    assert seen == [1]
    assert cpu_matmul.choose_quantized(True, (QUANT_SHAPE,), kind, fp32_rows=cpu_matmul.ALL_ROWS) == cpu_matmul.ALL_ROWS
    assert seen == [1, 1, 16]  # measured again: another fp32 bound is another key


def test_each_format_keeps_its_own_bound(cache, monkeypatch):
    """A machine's int8 bound is not its Q4_1 one: kept under the kind, each read back as raced."""
    bounds = {"int8": 16, "q8_0": 32, "q4_1": 256}
    monkeypatch.setattr(cpu_matmul, "measure_quantized", lambda shapes, kind, vocab=False, fp32_rows=0: bounds[kind])
    for module in (cpu_gemm_int8, cpu_gemm_gguf):
        monkeypatch.setattr(module, "available", lambda: True)
    assert {k: cpu_matmul.choose_quantized(True, (QUANT_SHAPE,), k) for k in KINDS} == bounds
    monkeypatch.setattr(cpu_matmul, "measure_quantized", lambda *a, **k: pytest.fail("measured again"))
    assert {k: cpu_matmul.choose_quantized(True, (QUANT_SHAPE,), k) for k in KINDS} == bounds


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_projections_take_the_kernel_up_to_the_bound_and_dequantize_past_it(cache, monkeypatch, kind):
    if not _module(kind).available():
        pytest.skip(f"no {kind} kernel on this CPU")
    monkeypatch.setattr(cpu_matmul, "measure_quantized", lambda shapes, kind, vocab=False, fp32_rows=0: 4)
    _keep_bounds(monkeypatch)
    assert layers.use_quantized_kernel(True, (QUANT_SHAPE,), kind) == 4 == layers.QUANTIZED_KERNEL_ROWS
    want_weight, project = _quantized(QUANT_SHAPE, kind)
    kernel = _counting_kernel(monkeypatch, kind)
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, QUANT_SHAPE[1])
        torch.testing.assert_close(project(x).double(), x.double() @ want_weight.t(), rtol=1e-4, atol=1e-3)
    assert kernel == [1, 4]


@pytest.mark.parametrize("kind", KINDS)
def test_the_vocabulary_projection_races_on_its_own_shape_and_keeps_its_own_bound(cache, monkeypatch, kind):
    """Past its bound a vocabulary projection dequantizes the whole vocabulary for each call, so
    it is raced on its own [vocab, hidden] shape (VOCAB_ROWS), kept apart from the layers' bound,
    and a projection with vocab=True obeys it while the layers obey theirs."""
    if not _module(kind).available():
        pytest.skip(f"no {kind} kernel on this CPU")
    raced = []

    def ratio(kernel, other, x, pool, pairs=cpu_matmul.PAIRS):
        raced.append((x.shape[0], tuple(pool[0].shape)))
        return 0.5 if x.shape[0] <= 64 else 2.0

    vocab_shape = (256, 64)
    monkeypatch.setattr(cpu_matmul, "ratio", ratio)
    monkeypatch.setattr(cpu_matmul, "measure_quantized", lambda shapes, kind, vocab=False, fp32_rows=0: 4 if not vocab
                        else cpu_matmul.bound(cpu_matmul.VOCAB_ROWS, lambda m: ratio(None, None, torch.empty(m, 1),
                                                                                     [torch.empty(shapes[0])])))
    _keep_bounds(monkeypatch)
    assert layers.use_quantized_kernel(True, (QUANT_SHAPE,), kind, vocab_shape=vocab_shape) == 4
    assert (layers.QUANTIZED_KERNEL_ROWS, layers.QUANTIZED_VOCAB_KERNEL_ROWS) == (4, 64)
    assert [m for m, _ in raced] == list(cpu_matmul.VOCAB_ROWS)
    assert {"vocab_kernel_rows": 64} in json.loads(cache.read_text()).values()
    want_weight, project = _quantized(vocab_shape, kind)
    kernel = _counting_kernel(monkeypatch, kind)
    for rows in (5, 64, 65):
        x = torch.randn(rows, vocab_shape[1])
        torch.testing.assert_close(project(x, vocab=True).double(), x.double() @ want_weight.t(), rtol=1e-4, atol=1e-3)
        project(x)  # as a layer: 4 rows
    assert kernel == [5, 64]


@pytest.mark.parametrize("kind", ["int8", "q8_0"])
def test_the_vocabulary_race_times_the_kernel_against_the_dequantized_gemm_on_its_shape(cache, monkeypatch, kind):
    if not _module(kind).available():
        pytest.skip(f"no {kind} kernel on this CPU")
    raced = []

    def ratio(kernel, other, x, pool, pairs=cpu_matmul.PAIRS):
        (a,), (b,) = kernel(x, pool[0]), other(x, pool[0])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
        raced.append((x.shape[0], a.shape[1], pairs, len(pool)))
        return 0.5 if x.shape[0] <= 128 else 2.0

    monkeypatch.setattr(cpu_matmul, "ratio", ratio)
    assert cpu_matmul.choose_quantized(True, ((320, 64),), kind, vocab=True) == 128
    assert raced == [(m, 320, cpu_matmul.VOCAB_PAIRS, 2) for m in cpu_matmul.VOCAB_ROWS]
    assert cpu_matmul.choose_quantized(True, ((320, 64),), kind, vocab=True) == 128 and len(raced) == len(cpu_matmul.VOCAB_ROWS)


def test_measurements_are_kept_apart_from_the_cache_where_asked(tmp_path, monkeypatch, measured):
    """PAGODA_MEASUREMENTS holds the kept figures (the suite points it at its own folder); without
    it they sit in the cache folder, PAGODA_CACHE, beside the model's derived files."""
    calls, choice = measured
    monkeypatch.delenv("PAGODA_MEASUREMENTS", raising=False)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice
    assert (tmp_path / "cache" / f"{cpu_matmul.CACHE_NAME}.json").exists()
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path / "apart"))
    assert cpu_matmul.choose(True, SHAPE, BF16) == choice and len(calls) == 2  # not read from the cache
    assert (tmp_path / "apart" / f"{cpu_matmul.CACHE_NAME}.json").exists()
