"""The image's requirements: pyproject.toml's dependencies, less Triton on a CPU-only torch.

Triton (a gigabyte installed) serves only GPU attention, and worker/attention_backends.py imports it only
there; a CUDA or ROCm torch pulls it in by itself. So the CPU image stays small and the CUDA
variant differs by the torch index alone.

    python deploy/docker/requirements.py pyproject.toml > requirements.txt   (asks the installed torch)
    python deploy/docker/requirements.py pyproject.toml --cpu                 (for a CPU torch)
"""
from __future__ import annotations

import re
import sys
import tomllib


def requirements(pyproject: str, gpu: bool) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if gpu or re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() != "triton"]


def torch_has_gpu() -> bool:
    import torch
    return bool(torch.version.cuda or torch.version.hip)


if __name__ == "__main__":
    gpu = False if sys.argv[2:] == ["--cpu"] else torch_has_gpu()
    print("\n".join(requirements(sys.argv[1], gpu)))
