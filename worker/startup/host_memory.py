"""How the worker's process keeps the memory it frees (glibc's malloc, which torch's CPU allocator
uses): freed blocks stay in the heap for the next step instead of going back to the kernel.

Why: a step's activations are allocated and freed every layer, and glibc returned the large ones
to the kernel (blocks past its mmap threshold, and the heap's top past its trim threshold), so the
next layer's allocation faulted its pages in again: 150-260 thousand page faults in the offline
workload's steps, about a microsecond each in this VM (disabling only the trim, which also pins the
mmap threshold at 128 KB, made 1.55 million faults and the run 1.5 s slower). With allocations of
up to 32 MB (glibc's most) served from the heap and the heap never trimmed, 11-14 thousand were
left and the steps ran 3-4% faster (docs/benchmarks-history.md, "Stop 43"). The cost: the heap keeps its
peak, about a prefill chunk's activations, which the next prefill wants again."""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (4 * 1024 * 1024 * sizeof(long))
NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds for this process; False where malloc is not glibc's (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    if not kept:
        logger.info("malloc took no thresholds: freed activations go back to the kernel")
    return kept
