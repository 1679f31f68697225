"""worker/startup/measurements.py: the prefill rate a worker reports is timed on a machine's first
start and read back on the next ones (the warm-up forward runs every time); another model shape
or dtype is timed again, and so is every one with --measure-again, which keeps the new figure;
tensor-parallel ranks always time it together (their forwards meet in
collectives, and a rank that read the kept figure would leave the others waiting). Whether the
CPU decode attention prefetches its blocks follows the faster of off and on, timed on the cache."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pagoda.kernels import cpu_decode_attention
from worker.startup import measurements as startup_measurements


@pytest.fixture
def forwards(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    calls = []

    def fake(runner, num_tokens, kv_caches, num_blocks):
        calls.append(num_tokens)
        return num_tokens

    monkeypatch.setattr(startup_measurements, "dummy_forward", fake)
    return calls


def runner(config="cfg-a", dtype=torch.float32, tp=1, again=False):
    return SimpleNamespace(
        cache=SimpleNamespace(num_blocks=64, kv_caches=None), block_size=16, max_model_len=1024,
        args=SimpleNamespace(max_num_batched_tokens=2048, quantization=None, measure_again=again),
        device=torch.device("cpu"), config=config, dtype=dtype, tp=SimpleNamespace(size=tp),
        backend=SimpleNamespace(name="torch"))


def test_the_prefill_rate_is_kept_and_the_warm_up_runs_every_start(forwards, tmp_path):
    first = startup_measurements.measure_prefill(runner())
    assert forwards == [16, 256] and first > 0
    forwards.clear()
    assert startup_measurements.measure_prefill(runner()) == first
    assert forwards == [16]  # the warm-up only
    (entry,) = json.loads((tmp_path / "prefill.json").read_text()).values()
    assert entry == {"tokens_per_s": first}
    forwards.clear()
    startup_measurements.measure_prefill(runner(config="cfg-b"))
    startup_measurements.measure_prefill(runner(dtype=torch.bfloat16))
    assert forwards == [16, 256, 16, 256]


def test_measure_again_times_it_whatever_was_kept_and_keeps_the_new_figure(forwards, monkeypatch):
    first = startup_measurements.measure_prefill(runner())
    ticks, real = [0.0, 0.5], startup_measurements.time.perf_counter  # 256 tokens in half a second
    monkeypatch.setattr(startup_measurements.time, "perf_counter", lambda: ticks.pop(0) if ticks else real())
    forwards.clear()
    assert startup_measurements.measure_prefill(runner(again=True)) == 512.0 != first
    assert forwards == [16, 256] and not ticks
    forwards.clear()
    assert startup_measurements.measure_prefill(runner()) == 512.0 and forwards == [16]  # kept


def test_tensor_parallel_ranks_always_time_it_together(forwards, tmp_path):
    for _ in range(2):
        assert startup_measurements.measure_prefill(runner(tp=2)) > 0
    assert forwards == [16, 256, 16, 256]
    assert not (tmp_path / "prefill.json").exists()


# Whether decode attention prefetches its blocks (measure_attention_prefetch).


def attention_runner(num_blocks=1024, dtype=torch.float32, again=False, layers=2):
    shape = (num_blocks, 16, 3, 64)  # SmolLM2's kv heads and head dim, blocks of 16
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(layers)]
    return SimpleNamespace(cache=SimpleNamespace(num_blocks=num_blocks, kv_caches=caches), block_size=16,
                           device=torch.device("cpu"), args=SimpleNamespace(measure_again=again),
                           config=SimpleNamespace(num_heads=9, num_kv_heads=3, name="cfg-a"))


@pytest.fixture
def timed_attention(tmp_path, monkeypatch):
    """decode() replaced by a recorder on a stand-in clock: each call costs costs[ahead]."""
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    monkeypatch.setattr(cpu_decode_attention, "prefetch", True)  # put back afterwards
    clock, calls, costs = [0.0], [], {True: 1.0, False: 1.0}

    def decode(q, k, v, rows, lens, tables, scale, out, ahead=None):
        calls.append(ahead)
        clock[0] += costs[ahead]

    monkeypatch.setattr(cpu_decode_attention, "decode", decode)
    monkeypatch.setattr(startup_measurements.time, "perf_counter", lambda: clock[0])
    return calls, costs


def test_the_attention_prefetch_is_off_where_off_is_faster_and_the_choice_is_kept(timed_attention, tmp_path):
    calls, costs = timed_attention
    costs[False] = 0.9  # leaving the blocks to the hardware saves a tenth
    startup_measurements.measure_attention_prefetch(attention_runner())
    assert cpu_decode_attention.prefetch is False
    pairs = 1 + startup_measurements.PREFETCH_PAIRS
    assert calls == [False, False, True, True] * pairs  # each call over both layers, off then on
    (entry,) = json.loads((tmp_path / "attention-prefetch.json").read_text()).values()
    assert entry == {"prefetch": False}
    calls.clear()
    cpu_decode_attention.prefetch = True
    startup_measurements.measure_attention_prefetch(attention_runner())  # read back, not timed
    assert calls == [] and cpu_decode_attention.prefetch is False
    costs[False] = 0.98  # within the margin: a tie keeps the kernel's prefetch
    startup_measurements.measure_attention_prefetch(attention_runner(again=True))
    assert cpu_decode_attention.prefetch is True and len(calls) == 4 * pairs
    assert list(json.loads((tmp_path / "attention-prefetch.json").read_text()).values()) == [{"prefetch": True}]


def test_a_cache_too_small_to_time_in_keeps_the_default(timed_attention, tmp_path):
    calls, _ = timed_attention
    startup_measurements.measure_attention_prefetch(attention_runner(num_blocks=64))
    assert calls == [] and cpu_decode_attention.prefetch is True
    assert not (tmp_path / "attention-prefetch.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_race_runs_the_kernel_both_ways_on_the_caches_blocks(tmp_path, monkeypatch, dtype):
    """The real kernel, off and on, on every layer's cache: PREFETCH_ROWS rows whose contexts lie
    in PREFETCH_CONTEXTS, over distinct blocks of the cache, the same attention either way."""
    if not cpu_decode_attention.available():
        pytest.skip("no decode attention kernel on this CPU")
    monkeypatch.setenv("PAGODA_MEASUREMENTS", str(tmp_path))
    monkeypatch.setattr(cpu_decode_attention, "prefetch", True)
    real, seen = cpu_decode_attention.decode, []

    def decode(q, k, v, rows, lens, tables, scale, out, ahead=None):
        real(q, k, v, rows, lens, tables, scale, out, ahead=ahead)
        seen.append((ahead, k.data_ptr(), out.clone(), lens.clone(), tables.clone()))

    monkeypatch.setattr(cpu_decode_attention, "decode", decode)
    runner = attention_runner(dtype=dtype)
    for k, v in runner.cache.kv_caches:
        k.normal_(), v.normal_()
    startup_measurements.measure_attention_prefetch(runner)
    assert {ptr for _, ptr, *_ in seen} == {k.data_ptr() for k, _ in runner.cache.kv_caches}
    off, on = seen[0], seen[2]
    assert (off[0], on[0]) == (False, True) and torch.equal(off[2], on[2]) and not off[2].isnan().any()
    lens, tables = off[3], off[4]
    lo, hi = startup_measurements.PREFETCH_CONTEXTS
    assert lens.numel() == startup_measurements.PREFETCH_ROWS and lo <= lens.min() and lens.max() < hi
    used = torch.cat([tables[i, :-(-int(n) // 16)] for i, n in enumerate(lens)])
    assert used.unique().numel() == used.numel() and 0 <= used.min() and used.max() < 1024
