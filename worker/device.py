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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Without AMX a CPU emulates bf16 matmuls and runs them slower than fp32.
    return torch.bfloat16 if cpu_has_amx() else torch.float32


@functools.cache
def cpu_has_amx() -> bool:
    if "AMX" in torch.backends.cpu.get_cpu_capability().upper():
        return True
    # torch reports AVX512 on AMX machines too (AMX is not an ISA level it dispatches on).
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False
