"""worker/startup/host_memory.py: with glibc's thresholds set, memory a step frees stays in the process,
so the next step's allocations of the same size fault no pages in again."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from worker.startup.host_memory import keep_freed_memory

MB = 2**20


def _faults_of(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_activations_are_reused_without_faulting_pages_in_again():
    assert keep_freed_memory()

    def layer():  # a prefill chunk's activations: allocated, written, freed
        for size in (12 * MB, 6 * MB, 3 * MB):
            torch.ones(size // 2, dtype=torch.bfloat16)
    passes = [_faults_of(layer) for _ in range(4)]  # the first passes grow the heap
    print(f"page faults of each pass: {passes}")
    assert passes[-1] < 64, passes  # 21 MB would be 5,376 pages
