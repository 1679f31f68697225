"""The CPU KV cache's memory (worker/cache.py zeroed_host): zeros, 64-byte aligned, of every
dtype, and resident only once written, so that a worker's start-up does not write the whole
cache and its memory grows with the blocks it uses."""
from __future__ import annotations

import os

import pytest
import torch

from worker.cache import zeroed_host

MB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_zeroed_host_is_aligned_zeros_of_its_shape(dtype):
    t = zeroed_host((3, 2, 5, 16, 2, 64), dtype)
    assert (t.shape, t.dtype, t.is_contiguous(), t.data_ptr() % 64) == ((3, 2, 5, 16, 2, 64), dtype, True, 0)
    assert not t.any()
    t[1, 0, 4] = 1  # a view of memory it owns, writable
    assert int(t.sum()) == 16 * 2 * 64


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_cache_is_resident_only_once_written():
    before = resident_bytes()
    t = zeroed_host((256 * MB // 4,), torch.float32)
    allocated = resident_bytes() - before
    t.fill_(1.0)
    written = resident_bytes() - before
    assert allocated < 16 * MB and written > 200 * MB, (allocated / MB, written / MB)
