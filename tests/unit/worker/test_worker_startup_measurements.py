"""worker/startup_measurements.py: the prefill rate a worker reports is timed on a machine's first
start and read back on the next ones (the warm-up forward runs every time); another model shape
or dtype is timed again, and so is every one with --measure-again, which keeps the new figure;
tensor-parallel ranks always time it together (their forwards meet in
collectives, and a rank that read the kept figure would leave the others waiting)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from worker import startup_measurements


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
