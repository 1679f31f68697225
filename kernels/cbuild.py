"""Builds a C kernel of kernels/csrc/ into a shared library with the system C compiler, once:
named by a hash of its source and flags (an edited source is rebuilt, a stale library is never
loaded), built beside its final name and renamed (processes that start at once never load half
a file)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BUILD_DIR = Path(__file__).resolve().parent / "build"


def library_path(source: Path, flags: list[str]) -> Path:
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    return BUILD_DIR / f"{source.stem}-{digest}.so"


def build(source: Path, flags: list[str]) -> Path:
    """Compiles the library unless the one for this source exists; returns its path."""
    path = library_path(source, flags)
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(source)], check=True,
                       capture_output=True, text=True)
        # mkstemp made it 0600 (the linker adds only x): readable by every user that may load
        # it, such as a container's unprivileged one.
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def row_major(x, w):
    """x [M, K] and w [N, K] with contiguous rows, as the kernels read them (a column slice of a
    wider tensor keeps its row stride)."""
    return (x if x.stride(1) == 1 else x.contiguous()), (w if w.stride(1) == 1 else w.contiguous())
