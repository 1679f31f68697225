"""kernels/csrc/cpu_gemm.c against a float64 product: every block shape and tail of the kernel, strided
rows, any thread count, and the build that refuses to load a stale or missing library."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagoda.kernels import cbuild, cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no AVX2 or no C compiler")

GEN = torch.Generator().manual_seed(0)


def check(x: torch.Tensor, w: torch.Tensor, threads: int = 2) -> None:
    """On every path this CPU runs (AVX-512F, AVX2): the test output names them."""
    want = x.double() @ w.double().t()
    # fp32 products summed over K: the error grows like sqrt(K) eps |x||w|.
    tol = 4e-6 * (x.shape[1] ** 0.5 + 1) * (x.abs().max().item() * w.abs().max().item() + 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in cpu_gemm.supported_isas():
            got = cpu_gemm.xwt(x, w, isa)
            assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
            assert (got.double() - want).abs().max().item() <= tol, cpu_gemm.ISA_NAMES[isa]
    finally:
        torch.set_num_threads(before)


def test_the_paths_here_are_named():
    print(f"fp32 matmul paths here: {[cpu_gemm.ISA_NAMES[i] for i in cpu_gemm.supported_isas()]}")
    assert cpu_gemm.supported_isas()[-1] == 1  # AVX2 + FMA: the floor the library is built for


# Rows 1-6 and their sums cover every block of x (AVX2: 3, 2, 1 rows; AVX-512: 1-6); N mod 4 the
# single-row blocks of w; K mod 8 and mod 16 the masked tails; 97 rows two row chunks; 49152 x 576
# the LM head of SmolLM2.
@pytest.mark.parametrize("M,N,K", [
    (1, 1, 1), (1, 4, 8), (2, 5, 7), (3, 8, 9), (4, 13, 16), (5, 7, 15), (6, 9, 31), (11, 6, 17), (15, 960, 576),
    (16, 576, 1536), (64, 3072, 576), (97, 9, 33), (200, 37, 100), (16, 49152, 576)])
def test_equals_float64(M, N, K):
    check(torch.randn(M, K, generator=GEN), torch.randn(N, K, generator=GEN))


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_any_thread_count_covers_every_column(threads):
    """Shares of w's rows in 4-row groups, the last thread taking the rest: with more threads than
    groups some get nothing, and no column is left unwritten."""
    check(torch.randn(5, 19, generator=GEN), torch.randn(23, 19, generator=GEN), threads)


def test_strided_rows_and_columns():
    """x a column slice of a wider tensor (row stride > K), as q and k are in qkv; a transposed w
    is made contiguous first."""
    wide = torch.randn(7, 50, generator=GEN)
    check(wide[:, 3:43], torch.randn(11, 40, generator=GEN))
    check(torch.randn(7, 40, generator=GEN), torch.randn(40, 11, generator=GEN).t())


def test_empty_shapes():
    assert cpu_gemm.xwt(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert cpu_gemm.xwt(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    assert torch.equal(cpu_gemm.xwt(torch.randn(3, 0), torch.randn(4, 0)), torch.zeros(3, 4))


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 40), N=st.integers(1, 40), K=st.integers(1, 70), threads=st.integers(1, 4))
def test_any_shape_equals_float64(M, N, K, threads):
    g = torch.Generator().manual_seed(M * 10_000 + N * 100 + K)
    check(torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), threads)


def test_library_is_named_by_its_source(tmp_path, monkeypatch):
    """An edited source gets a new library name, so a stale build is never loaded."""
    for header in cpu_gemm.SOURCE.parent.glob("*.h"):  # what it includes
        (tmp_path / header.name).write_bytes(header.read_bytes())
    source = tmp_path / "cpu_gemm.c"
    source.write_bytes(cpu_gemm.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_gemm, "SOURCE", source)
    before = cpu_gemm.library_path()
    source.write_bytes(source.read_bytes() + b"\n/* edited */\n")
    assert cpu_gemm.library_path() != before


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(cbuild, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_gemm.build()
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_the_built_library_is_readable_by_every_user(tmp_path, monkeypatch):
    """A container builds it as root and runs its worker as another user, who must load it."""
    monkeypatch.setattr(cbuild, "BUILD_DIR", tmp_path)
    path = cpu_gemm.build()
    assert path.stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("name", [name for name, _ in cpu_gemm.EVERY_KERNEL])
def test_every_kernel_builds_here(name):
    """A kernel that fails to compile is only a warning to the worker (it falls back to torch),
    and its tests would skip as on a CPU it cannot run on: the build itself must pass."""
    import importlib
    import shutil
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here")
    kernel = importlib.import_module(f"pagoda.kernels.{name}")
    assert cbuild.build(kernel.SOURCE, kernel.FLAGS).exists()


def test_an_installed_package_ships_every_kernel_source():
    """The kernels are built from their sources on first use, headers included: a wheel that
    left one out would turn its kernels off wherever pagoda is pip-installed."""
    import fnmatch
    import tomllib
    globs = tomllib.loads((cpu_gemm.SOURCE.parents[2] / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["pagoda.kernels"]
    sources = [p.relative_to(cpu_gemm.SOURCE.parents[1]).as_posix()
               for p in cpu_gemm.SOURCE.parent.iterdir() if p.suffix in (".c", ".h")]
    assert len(sources) > 10
    assert [s for s in sources if not any(fnmatch.fnmatch(s, g) for g in globs)] == []
