"""Each C kernel checks itself against its float64 (or torch) reference once a process, on the
first available(), and is off with one log line when it disagrees: the fp32, bf16, int8 and
GGUF matmuls, the decode and prefill attention, the bf16 pointwise kernels and the grammar mask here, the fused decode step in
tests/unit/kernels/test_kernels_cpu_decode_layer.py. Each check passes with the real
kernel on this CPU and fails with a kernel that computes nothing."""
from __future__ import annotations

import logging

import pytest
import torch

from pagoda.kernels import (cbuild, cpu_decode_attention, cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8,
                     cpu_pointwise, cpu_prefill_attention, grammar_mask)

MODULES = {"fp32": cpu_gemm, "bf16": cpu_gemm_bf16, "int8": cpu_gemm_int8, "gguf": cpu_gemm_gguf, "decode_attention": cpu_decode_attention,
           "prefill_attention": cpu_prefill_attention, "pointwise": cpu_pointwise}


@pytest.mark.parametrize("name", list(MODULES))
def test_the_check_passes_with_the_kernel_and_fails_with_one_that_computes_nothing(name, monkeypatch):
    module = MODULES[name]
    if not module.available():
        pytest.skip(f"no {name} kernel on this CPU")
    print(f"\n{name} kernel checked on this CPU: {module.isa()}")
    assert module.agrees_with_reference()
    poison_allocations(monkeypatch)
    monkeypatch.setattr(module._kernel, "fn", lambda *args: None)  # leaves its output as allocated
    assert not module.agrees_with_reference()


def poison_allocations(monkeypatch):
    """New float tensors start as NaN: a kernel that writes nothing cannot pass on what the
    allocator handed back from the previous, correct product."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, real=real, **k: (
            lambda t: t.fill_(float("nan")) if t.is_floating_point() else t)(real(*a, **k)))


def test_the_grammar_mask_check_fails_with_a_kernel_that_masks_nothing(monkeypatch):
    if not grammar_mask.available():
        pytest.skip("no grammar mask kernel here")
    assert grammar_mask.agrees_with_reference()
    monkeypatch.setattr(grammar_mask._kernel, "fn", lambda *args: None)
    assert not grammar_mask.agrees_with_reference()


def _fresh(module) -> cbuild.IsaKernel:
    k = module._kernel
    return cbuild.IsaKernel(k.source, k.flags, k.isa_symbol, k.fn_symbol, k.argtypes, k.names, k.off)


@pytest.mark.parametrize("outcome", ["disagrees", "raises"])
def test_a_kernel_whose_check_fails_is_off_with_one_log_line(outcome, caplog):
    if not cpu_gemm_int8.available():
        pytest.skip("no int8 kernel on this CPU")
    kernel = _fresh(cpu_gemm_int8)

    def check():
        if outcome == "raises":
            raise RuntimeError("boom")
        return False

    kernel.check = check
    with caplog.at_level(logging.WARNING):
        assert kernel.available() is False and kernel.available() is False
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "it is off" in said[0]
    assert ("disagrees with float64" if outcome == "disagrees" else "boom") in said[0]
    ok = _fresh(cpu_gemm_int8)
    ok.check = lambda: True
    assert ok.available() is True
