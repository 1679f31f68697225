"""The image's requirements: pyproject.toml's dependencies, less Triton on a CPU-only torch.

Triton (a gigabyte installed) serves only GPU attention, and worker/model/attention_backends.py imports it only
there; a CUDA or ROCm torch pulls it in by itself. So the CPU image stays small and the CUDA
variant differs by the torch index alone. xgrammar depends on Triton too (for its GPU mask
kernel, imported only for CUDA tensors), so on a CPU torch it is installed without its
dependencies (--no-deps-group), and its one dependency the list lacks is named here.

    python deploy/docker/requirements.py pyproject.toml > requirements.txt   (asks the installed torch)
    python deploy/docker/requirements.py pyproject.toml --cpu                 (for a CPU torch)
    python deploy/docker/requirements.py pyproject.toml --no-deps-group       (pip install --no-deps)
"""
from __future__ import annotations

import re
import sys
import tomllib


# Installed with --no-deps on a CPU torch, with what they need besides Triton.
CPU_NO_DEPS = {"xgrammar": ["apache-tvm-ffi==0.1.15.post2"]}


def _name(dep: str) -> str:
    return re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower()


def requirements(pyproject: str, gpu: bool) -> list[str]:
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    if gpu:
        return deps
    return [d for d in deps if _name(d) != "triton" and _name(d) not in CPU_NO_DEPS]


def no_deps_group(pyproject: str, gpu: bool) -> list[str]:
    """What the image installs with --no-deps after requirements() (nothing on a GPU torch)."""
    if gpu:
        return []
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [x for d in deps if _name(d) in CPU_NO_DEPS for x in (d, *CPU_NO_DEPS[_name(d)])]


def torch_has_gpu() -> bool:
    import torch
    return bool(torch.version.cuda or torch.version.hip)


if __name__ == "__main__":
    flags = sys.argv[2:]
    gpu = False if "--cpu" in flags else torch_has_gpu()
    group = no_deps_group if "--no-deps-group" in flags else requirements
    print("\n".join(group(sys.argv[1], gpu)))
