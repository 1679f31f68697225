"""Builds a C kernel of kernels/csrc/ into a shared library with the system C compiler, once:
named by a hash of its source and flags (an edited source is rebuilt, a stale library is never
loaded), built beside its final name and renamed (processes that start at once never load half
a file)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

BUILD_DIR = Path(__file__).resolve().parent / "build"

# The flags of the kernels that take exp_poly (kernels/csrc/cpu_attention_math.h). Under GCC's
# default trapping math the AVX2 build keeps exp_poly's clamp a branch, which leaves every exp of
# a softmax or a SiLU scalar (the AVX-512 build masks it): a third of the fp32 prefill
# attention's time. No kernel reads the floating-point exception flags.
EXP_KERNEL_FLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]


def library_path(source: Path, flags: list[str]) -> Path:
    digest = hashlib.sha256(b"".join(_source_bytes(source)) + " ".join(flags).encode()).hexdigest()[:16]
    return BUILD_DIR / f"{source.stem}-{digest}.so"


def _source_bytes(source: Path, seen: set[Path] | None = None) -> list[bytes]:
    """The source and every file it includes with quotes, each once: an edit to an included
    kernel rebuilds the libraries that include it."""
    seen = set() if seen is None else seen
    if source in seen:
        return []
    seen.add(source)
    text = source.read_bytes()
    parts = [text]
    for name in re.findall(rb'^\s*#include\s+"([^"]+)"', text, flags=re.MULTILINE):
        parts += _source_bytes(source.parent / name.decode(), seen)
    return parts


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


class IsaKernel:
    """A kernel library with paths for several instruction sets, built and loaded on first use:
    `isa_symbol()` returns the best path the CPU runs (0: none), `fn_symbol` is the entry point,
    whose last argument is the path to take. Where it cannot build or run, available() is False
    and one log line says why (`off`: what the caller does instead). A module may set `check`:
    a comparison of its best path with float64 on a small random case, run once a process on
    the first available(); a kernel that disagrees is off, with one log line."""

    def __init__(self, source: Path, flags: list[str], isa_symbol: str, fn_symbol: str,
                 argtypes: list, names: dict[int, str], off: str) -> None:
        self.source, self.flags, self.names, self.off = source, flags, names, off
        self.isa_symbol, self.fn_symbol, self.argtypes = isa_symbol, fn_symbol, argtypes
        self.fn = self.lib = None  # lib: for a library's other entry points
        self.best = 0
        self.check = None  # () -> bool, set by the kernel's module
        self._tried = False
        self._functions: dict[str, object] = {}

    def available(self) -> bool:
        if not self._tried:
            self._tried = True
            log = logging.getLogger(f"pagoda.kernels.{self.source.stem}")
            try:
                lib = ctypes.CDLL(str(build(self.source, self.flags)))
            except (OSError, RuntimeError) as e:
                log.warning("%s kernel off, %s: %s", self.source.stem, self.off, e)
                return False
            self.best = getattr(lib, self.isa_symbol)()
            if self.best == 0:
                log.info("%s kernel off, %s: the CPU has none of %s", self.source.stem, self.off,
                         ", ".join(self.names.values()))
                return False
            fn = getattr(lib, self.fn_symbol)
            fn.argtypes, fn.restype = self.argtypes, None
            self.fn, self.lib = fn, lib
            if self.check is not None and not self._agrees(log):
                self.fn = None
        return self.fn is not None

    def _agrees(self, log: logging.Logger) -> bool:
        try:
            ok = bool(self.check())
        except Exception as e:  # a kernel that fails its own check is as off as a wrong one
            log.warning("%s kernel's start-up check failed (%s): it is off, %s", self.source.stem, e, self.off)
            return False
        if not ok:
            log.warning("the %s kernel (%s) disagrees with float64 on this machine: it is off, %s",
                        self.source.stem, self.names.get(self.best), self.off)
        return ok

    def function(self, name: str, argtypes: list, restype=None):
        """Another entry point of the library, typed once (call only after available())."""
        fn = self._functions.get(name)
        if fn is None:
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            self._functions[name] = fn
        return fn

    def isa(self) -> str | None:
        """The instruction set the kernel runs on here, or None where it does not run."""
        return self.names.get(self.best) if self.available() else None

    def supported_isas(self) -> list[int]:
        """Every path this CPU can run, best first (each is tested)."""
        return [i for i in sorted(self.names, reverse=True) if self.available() and i <= self.best]
