"""Which device and dtype --device auto and --dtype auto mean on this machine."""
from __future__ import annotations

import functools

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        # With an index, so that hello reports which GPU (CUDA_VISIBLE_DEVICES picks it).
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """quantized: --quantization's weights, which run with fp32 activations only."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if quantized:
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # A CPU with bf16 instructions (AVX512-BF16 dot products or AMX tiles) computes bf16 at up to twice
    # fp32's rate and reads half the bytes: bf16 served SmolLM2's offline workload 1.7x faster than
    # fp32 on a Zen 5 EPYC (docs/benchmarks-history.md, "Stop 41"). Without them torch emulates bf16
    # matmuls and runs batches slower than fp32 (stop 36).
    return torch.bfloat16 if cpu_computes_bf16() else torch.float32


BF16_FLAGS = {"avx512_bf16", "amx_bf16"}  # /proc/cpuinfo's names


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 instructions (torch reports AVX512 on AMX machines too, and
    nothing of AVX512-BF16, so the kernel's flags decide)."""
    return bool(BF16_FLAGS & cpu_flags())


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()
