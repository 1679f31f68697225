"""The CPU KV cache's memory (worker/model/kv_cache.py zeroed_host): zeros, aligned to a huge page, of
every dtype, resident only once written, so that a worker's start-up does not write the whole
cache and its memory grows with the blocks it uses, and in huge pages where the kernel gives them."""
from __future__ import annotations

import os

import pytest
import torch

from worker.model.kv_cache import HUGE_PAGE, zeroed_host

MB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_zeroed_host_is_aligned_zeros_of_its_shape(dtype):
    t = zeroed_host((3, 2, 5, 16, 2, 64), dtype)
    assert (t.shape, t.dtype, t.is_contiguous(), t.data_ptr() % HUGE_PAGE) == ((3, 2, 5, 16, 2, 64), dtype, True, 0)
    assert not t.any()
    t[1, 0, 4] = 1  # a view of memory it owns, writable
    assert int(t.sum()) == 16 * 2 * 64


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_an_unpopulated_area_is_resident_only_once_written():
    before = resident_bytes()
    t = zeroed_host((256 * MB // 4,), torch.float32)
    allocated = resident_bytes() - before
    t.fill_(1.0)
    written = resident_bytes() - before
    assert allocated < 16 * MB and written > 200 * MB, (allocated / MB, written / MB)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_populated_cache_is_resident_at_once_and_still_zeros():
    before = resident_bytes()
    t = zeroed_host((64 * MB // 2,), torch.bfloat16, populate=True)
    assert resident_bytes() - before > 60 * MB
    assert not t.any()


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason=f"transparent huge pages {_thp_mode()} in this kernel")
def test_a_written_cache_lies_in_huge_pages():
    t = zeroed_host((16 * MB // 4,), torch.float32)
    t.fill_(1.0)
    assert _huge_bytes_at(t.data_ptr()) >= 8 * MB
