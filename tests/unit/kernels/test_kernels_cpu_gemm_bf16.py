"""kernels/csrc/cpu_gemm_bf16.c against a float64 product of the same bf16 values, on every
instruction-set path this CPU has (the test names which ran), 1-4 rows both ways: every row block and K tail,
weight-row groups of 1 to 4, AMX's row blocks and weight tails, strided rows, any thread count."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_gemm_bf16 as bf16
from pagoda.kernels.reference import bf16_matmul_error

pytestmark = pytest.mark.skipif(not bf16.available(), reason="no AVX2, or no C compiler")

GEN = torch.Generator().manual_seed(0)
PATHS = bf16.supported_isas() if bf16.available() else []


def check(x: torch.Tensor, w: torch.Tensor, isa: int, threads: int = 2, few_tiles: bool = False) -> None:
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = bf16.xwt(x, w, isa, few_tiles)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == torch.bfloat16
    assert bf16_matmul_error(got, x, w) <= 1


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: bf16.ISA_NAMES[i])
@pytest.mark.parametrize("M,N,K", [
    (1, 1, 1), (1, 4, 31), (2, 5, 32), (3, 8, 33), (4, 13, 64), (5, 7, 65), (8, 1536, 576),
    (1, 576, 1536), (9, 17, 100), (1, 49152, 576), (7, 6, 9), (64, 37, 100), (100, 3, 8),
    # AMX's shapes (K a multiple of 32): one row block and a tail of weights, two blocks, three
    (5, 32, 32), (17, 70, 64), (33, 96, 96), (40, 33, 576)])
@pytest.mark.parametrize("few_tiles", [False, True], ids=["rows", "tiles"])  # 1-4 rows' two ways
def test_equals_float64(M, N, K, isa, few_tiles):
    check(torch.randn(M, K, generator=GEN), torch.randn(N, K, generator=GEN), isa, few_tiles=few_tiles)


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: bf16.ISA_NAMES[i])
@pytest.mark.parametrize("threads", [1, 3])
def test_strided_rows_and_thread_counts(isa, threads):
    wide = torch.randn(6, 90, generator=GEN)
    check(wide[:, 5:69], torch.randn(23, 64, generator=GEN), isa, threads)
    # and strided weight rows, 45 of them: one AMX group and a tail
    check(wide[:, 5:69], torch.randn(45, 80, generator=GEN)[:, 8:72], isa, threads)


def test_the_best_path_of_this_cpu_is_named():
    print(f"\nbf16 kernel paths on this CPU: {[bf16.ISA_NAMES[i] for i in PATHS]}")
    assert bf16.isa() == bf16.ISA_NAMES[PATHS[0]]
