"""The paged KV cache on the device, the optional CPU swap area, and the block copies between them.

Both live in one tensor each, [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim], so that one swap or copy of a list of blocks is one gather and one scatter over all
layers at once instead of 2 * num_layers small copies.
"""
from __future__ import annotations

import contextlib
import logging
import math
import mmap
import time
from typing import Sequence

import torch

from worker.model.config import ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block over all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


def num_device_blocks(*, override: int | None, device: torch.device, block_bytes: int,
                      kv_cache_memory: int, gpu_memory_utilization: float,
                      profiled_peak_bytes: int = 0) -> int:
    """--num-gpu-blocks-override, else the budget divided by the block size: on the CPU the budget
    is --kv-cache-memory; on CUDA it is utilization * total memory minus the profiled peak of
    weights and activations."""
    if override:
        return int(override)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * gpu_memory_utilization) - profiled_peak_bytes
        if budget < block_bytes:
            raise RuntimeError(f"no room for a KV cache: {total * gpu_memory_utilization / 2**30:.1f} "
                               f"GiB allowed, {profiled_peak_bytes / 2**30:.1f} GiB taken by weights "
                               "and activations")
        return budget // block_bytes
    if kv_cache_memory < block_bytes:
        raise ValueError(f"--kv-cache-memory {kv_cache_memory} is less than one block ({block_bytes} bytes)")
    return kv_cache_memory // block_bytes


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def zeroed_host(shape: tuple, dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """Zeros in host memory, aligned to a huge page: an anonymous mapping, whose pages the kernel
    zeroes on first touch (where torch.zeros would write every byte itself), in huge pages where
    the kernel gives them (transparent_hugepage "madvise" or "always"). Decode attention reads
    blocks that lie anywhere, and with 4 KB pages nearly every block read missed the TLB
    (bench/bench_cpu_attention.py --decode: 26 against 23 ms for 64 bf16 rows).
    populate: every page touched now. A page's first touch costs far more than the write that
    makes it (in this VM, a 2048-token chunk's K/V writes took 115-400 ms over fresh pages against
    4 ms over touched ones), so a cache left to fill lazily charged its first gigabyte of use,
    about 0.4 s, to the first requests' steps; populated, start-up pays it once instead, and the
    memory is the worker's from the start, as a GPU's cache is. Unpopulated (the swap area),
    memory is resident only once written."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # no THP in this kernel, or not Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    skip = -raw.data_ptr() % HUGE_PAGE
    raw = raw[skip:skip + nbytes]
    if populate:
        raw[::mmap.PAGESIZE].zero_()  # a byte a page: each page (or huge page) faulted in once
    return raw.view(dtype).view(shape)


class CacheEngine:
    def __init__(self, config: ModelConfig, num_blocks: int, num_cpu_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_bytes = bytes_per_block(config, block_size, dtype)
        tail = (block_size, config.num_kv_heads, config.head_dim)
        # Zeros, not empty: attention multiplies masked-out slots by 0, and 0 * NaN garbage is NaN.
        shape = (config.num_layers, 2, num_blocks, *tail)
        started = time.perf_counter()
        self.device_cache = (zeroed_host(shape, dtype, populate=True) if device.type == "cpu"
                             else torch.zeros(shape, dtype=dtype, device=device))
        if device.type == "cpu":
            logger.info("KV cache: %d blocks, %.2f GiB, its pages touched in %.2f s", num_blocks,
                        self.device_cache.nbytes / 2**30, time.perf_counter() - started)
        self.cpu_cache = None
        if num_cpu_blocks:
            shape = (config.num_layers, 2, num_cpu_blocks, *tail)
            # pinned memory makes the copies asynchronous DMA
            self.cpu_cache = (torch.zeros(shape, dtype=dtype, pin_memory=True) if device.type == "cuda"
                              else zeroed_host(shape, dtype))
        # Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]: views, no copies.
        self.kv_caches = [(layer[0], layer[1]) for layer in self.device_cache]

    def swap_out(self, copies: Sequence) -> None:
        """Device block src -> CPU block dst, for each BlockCopy."""
        if copies:
            self._require_cpu()
            src, dst = _indices(copies, self.device_cache.device)
            self.cpu_cache.index_copy_(2, dst.cpu(), self.device_cache.index_select(2, src).cpu())

    def swap_in(self, copies: Sequence) -> None:
        """CPU block src -> device block dst."""
        if copies:
            self._require_cpu()
            src, dst = _indices(copies, self.device_cache.device)
            rows = self.cpu_cache.index_select(2, src.cpu()).to(self.device_cache.device, non_blocking=True)
            self.device_cache.index_copy_(2, dst, rows)

    def copy(self, copies: Sequence) -> None:
        """Device block src -> device block dst (copy-on-write). All reads happen before any write."""
        if copies:
            src, dst = _indices(copies, self.device_cache.device)
            self.device_cache.index_copy_(2, dst, self.device_cache.index_select(2, src))

    def measure_swap_bandwidth(self, max_blocks: int = 32) -> float:
        """Bytes per second of device -> CPU -> device block copies, for the scheduler's choice
        between swapping and recomputing. Uses a scratch buffer when there is no swap area."""
        n = max(1, min(max_blocks, self.num_blocks))
        blocks = self.device_cache[:, :, :n]
        scratch = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=blocks.is_cuda)
        for _ in range(2):  # the first round pays for page faults
            _sync(blocks.device)
            start = time.perf_counter()
            scratch.copy_(blocks, non_blocking=True)
            _sync(blocks.device)
            blocks.copy_(scratch, non_blocking=True)
            _sync(blocks.device)
            elapsed = time.perf_counter() - start
        return 2 * n * self.block_bytes / max(elapsed, 1e-9)

    def _require_cpu(self) -> None:
        if self.cpu_cache is None:
            raise RuntimeError("the plan swaps blocks but this worker has no swap space (--swap-space 0)")


def _indices(copies: Sequence, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = torch.tensor([(c.src, c.dst) for c in copies], dtype=torch.int64)
    return pairs[:, 0].to(device), pairs[:, 1].to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
