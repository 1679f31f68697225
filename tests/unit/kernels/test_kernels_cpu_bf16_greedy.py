"""kernels/csrc/cpu_bf16_greedy.h: the vocabulary projection's max without its logits. It must
give exactly the index torch's max gives over the kernel's own logits (xwt: the same products,
the same rounding), ties and NaN included, on every path this CPU has; and that index must be a
true maximum of the float64 products, within bf16's rounding."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_gemm_bf16 as bf16

PATHS = [i for i in (bf16.supported_isas() if bf16.available() else []) if i >= 2]
pytestmark = pytest.mark.skipif(not PATHS, reason="no AVX512-BF16 here: the projection's greedy max has no path")
GEN = torch.Generator().manual_seed(7)


def both(x: torch.Tensor, w: torch.Tensor, isa: int, few_tiles: bool, threads: int = 2):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = bf16.xwt(x, w, isa, few_tiles)
        return bf16.greedy(x, w, few_tiles=few_tiles, isa=isa), logits
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: bf16.ISA_NAMES[i])
@pytest.mark.parametrize("few_tiles", [False, True], ids=["rows", "tiles"])
@pytest.mark.parametrize("M,N,K", [
    (1, 1, 32), (1, 7, 33), (3, 13, 64), (4, 49152, 576), (5, 32, 32), (5, 70, 96), (8, 4099, 576),
    (16, 2048, 576), (17, 100, 64), (33, 96, 96), (64, 49152, 576), (100, 45, 80)])
def test_the_max_of_the_kernels_own_logits(M, N, K, isa, few_tiles):
    x = torch.randn(M, K, generator=GEN).bfloat16()
    w = torch.randn(N, K, generator=GEN).bfloat16()
    got, logits = both(x, w, isa, few_tiles)
    assert got.dtype == torch.int64 and got.shape == (M,)
    assert torch.equal(got, logits.float().max(dim=-1).indices)
    exact = x.double() @ w.double().t()
    best = exact.max(dim=-1).values
    # within two bf16 roundings of the true maximum (the chosen logit's and the maximum's)
    assert (exact.gather(1, got[:, None]).squeeze(1) >= best - 2 * 2.0 ** -8 * best.abs()).all()


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: bf16.ISA_NAMES[i])
@pytest.mark.parametrize("M", [2, 9, 40])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ties_take_the_first_index_and_nan_the_first_nan(isa, M, threads):
    N, K = 300, 64
    x = torch.randn(M, K, generator=GEN).bfloat16()
    w = torch.randn(N, K, generator=GEN).bfloat16()
    top = (x.float() @ w.float().t()).argmax(dim=-1)
    w[250] = w[top[0]]  # row 0's best twice: at top[0] and at 250
    w[280] = w[top[0]]
    w[299] = w[top[1]]
    x[M - 1, 3] = float("nan")  # the last row: every product NaN, the first is 0
    got, logits = both(x, w, isa, few_tiles=True, threads=threads)
    assert torch.equal(got, logits.float().max(dim=-1).indices)
    assert got[0] == min(int(top[0]), 250) and got[M - 1] == 0
    w[17, 5] = float("nan")  # a NaN column: every row's first NaN
    got, logits = both(x, w, isa, few_tiles=False, threads=threads)
    assert torch.equal(got, logits.float().max(dim=-1).indices)
    assert got[:M - 1].tolist() == [17] * (M - 1) and got[M - 1] == 0


def test_a_cpu_without_avx512_bf16_has_no_greedy_path():
    x, w = torch.randn(2, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert bf16.greedy(x, w, isa=1) is None
