"""tests/emulated's harness on this machine: every kernel call recorded through its Python
wrapper and replayed by tests/emulated/runner.c as a plain process (on the paths this CPU has)
agrees with float64. So the recording passes what a worker passes (pointers into the right
buffers, integers, the attention kernels' float scale), and a run in the emulator tests the kernels,
not the harness."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.emulated import bochs, check_kernels


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_recorded_calls_replayed_by_the_runner_agree_with_float64():
    before = torch.get_num_threads()
    calls = bochs.Calls()
    try:
        cases, _kept = check_kernels.build_cases(calls, torch.Generator().manual_seed(0), here=True)
    finally:
        torch.set_num_threads(before)
    result = bochs.run_here(calls)
    kernels = {case.tag.split("/")[0] for case in cases}
    assert kernels == {"bf16", "fp32", "int8", "q8_0", "q4_1", "attention", "prefill", "step"}
    bad = {case.tag: check_kernels.judged(case, result) for case in cases}
    assert not {tag: worst for tag, worst in bad.items() if not worst <= 1}
