"""Which path a CPU projection takes, by dtype and rows: pagoda's kernels (kernels/csrc/cpu_gemm.c,
kernels/csrc/cpu_gemm_bf16.c) where they are faster, torch's BLAS (MKL, oneDNN) where it is.

Decided once, at start-up (choose): a kernel that disagreed with float64 is off (its own
start-up check, kernels/cbuild.py IsaKernel.check); then the rows up to which it pays are measured on
this machine with the model's own MLP shape. The crossover belongs to the machine, not to its
instruction set: 64 rows on an AVX-512 Xeon, about 2048 on a Zen 3 EPYC, 256 on a later AVX2
EPYC (docs/benchmarks.md), so a table by instruction set was wrong somewhere whatever it said.
The measurement (about a second) is kept per machine, thread count, shape and kernel build
(worker/startup/kept.py: PAGODA_CACHE/cpu-matmul.json), so only a machine's first worker pays it."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pagoda.kernels import cbuild, cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8
from worker.startup.kept import how, kept, machine_key, timed

logger = logging.getLogger(__name__)

FP32_ROWS = (16, 64, 128, 256, 512, 1024)  # rows timed for the fp32 kernel, in order
BF16_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # and for the bf16 kernel (decode steps, short chunks)
QUANTIZED_ROWS = (1, 16, 32, 64, 128, 256, 512, 1024)  # and for int8 / GGUF kernels, against dequantized weights
QUANTIZED_DEFAULT_ROWS = 64  # their bound where it is not measured (--cpu-matmul torch)
VOCAB_ROWS = (16, 64, 128, 256)  # and for a quantized vocabulary projection (a step's sampled rows)
VOCAB_PAIRS = 3  # its pairs: each dequantized call writes the whole vocabulary's weights
WIDEN_ROWS = 256  # a prefill-sized product, where torch's bf16 matmul shows what it can do
PAIRS = 12  # timed pairs of calls per row count, at least
POOL_BYTES = 64 << 20  # distinct weights beyond a server CPU's last-level cache (32 MB here)
MAX_POOL = 64  # weights at most (a tiny model's would be thousands)
STREAM_ROWS = 64  # products of up to this many rows stream the whole pool
CACHE_NAME = "cpu-matmul"  # PAGODA_CACHE/cpu-matmul.json (worker/startup/kept.py)
# A bound that means every product: the kernel won at the largest row count timed. Past a few
# hundred rows both paths are bound by arithmetic and their rates no longer move with the rows
# (bench/bench_gemm.py: 160-163 against MKL's 112-132 GFLOP/s from 256 to 2048 rows on a Zen 2
# EPYC), so the winner there wins beyond; else a 2048-token prefill chunk went to the slower one.
ALL_ROWS = 2**31 - 1
BOUND_RULE = "rule=beyond-last"  # in the keys: bounds kept before ALL_ROWS existed are measured again


@dataclass(frozen=True)
class CpuMatmul:
    """The choice: rows up to which each kernel runs (0: off), and whether bf16 products past
    the bf16 kernel's rows are computed in fp32 on widened operands (a CPU without bf16
    instructions, where torch's bf16 matmul runs at about 15 GFLOP/s whatever the rows)."""
    fp32_kernel_rows: int = 0
    bf16_kernel_rows: int = 0
    bf16_widen: bool = False
    bf16_few_rows_tiles: bool = False  # 1-4 rows in the bf16 kernel's 4 x 4 tiles (cpu_gemm_bf16.xwt)


def choose(wanted: bool, shape: tuple[int, int], dtype: torch.dtype, again: bool = False) -> CpuMatmul:
    """--cpu-matmul auto (wanted) or torch: the paths for projections of a [shape] weight (out,
    in features) in a model of `dtype` on this machine, measured or read from the cache (measured
    whatever it holds with `again`, --measure-again). The fp32 bound serves bf16 models too (their
    widened products); the bf16 one only them."""
    fp32 = wanted and cpu_gemm.available()  # each checked against float64 on the first call
    bf16 = wanted and dtype == torch.bfloat16 and cpu_gemm_bf16.available()
    if not (fp32 or bf16):
        return CpuMatmul()
    builds = [cbuild.library_path(k.SOURCE, k.FLAGS).name if on else "-"
              for k, on in ((cpu_gemm, fp32), (cpu_gemm_bf16, bf16))]
    started = time.perf_counter()
    found, was_kept = kept(CACHE_NAME, machine_key(f"shape={shape[0]}x{shape[1]}", *builds,
                                                   timed(FP32_ROWS, BF16_ROWS), BOUND_RULE),
                           lambda: asdict(measure(fp32, bf16, shape)), set(asdict(CpuMatmul())), again)
    choice = CpuMatmul(**found)
    said = f"fp32 projections of {up_to(choice.fp32_kernel_rows)} rows run through kernels/cpu_gemm.c"
    if bf16:
        said += (f", bf16 ones of {up_to(choice.bf16_kernel_rows)} through kernels/cpu_gemm_bf16.c"
                 + (" (1-4 rows in its 4 x 4 tiles)" if choice.bf16_few_rows_tiles else "")
                 + (" and larger ones in fp32 on widened operands" if choice.bf16_widen else ""))
    logger.info("%s (%s)", said, how(was_kept, started))
    return choice


def measure(fp32: bool, bf16: bool, shape: tuple[int, int]) -> CpuMatmul:
    g = torch.Generator().manual_seed(0)
    pool = [torch.randn(*shape, generator=g) for _ in range(_pool_size(shape, 4))]
    x = torch.randn(max(FP32_ROWS), shape[1], generator=g)
    fp32_rows = bound(FP32_ROWS, lambda m: ratio(cpu_gemm.xwt, F.linear, x[:m], pool), beyond=True) if fp32 else 0
    if not bf16:
        return CpuMatmul(fp32_rows)

    def widened(xb, wb):  # what worker.model.layers.linear does with a widened bf16 product
        return fp32_product(fp32_rows)(xb.float(), wb.float()).to(torch.bfloat16)

    xb = x.bfloat16()
    pool = [torch.randn(*shape, generator=g).bfloat16() for _ in range(_pool_size(shape, 2))]
    widen = ratio(widened, F.linear, xb[:WIDEN_ROWS], pool, pairs=3) <= 1  # 5-10x either way
    other = widened if widen else F.linear
    tiles = max(cpu_gemm_bf16.supported_isas()) >= 2 and ratio(  # the AVX2 path has no such choice
        lambda x, w: cpu_gemm_bf16.xwt(x, w, few_tiles=True), cpu_gemm_bf16.xwt, xb[:1], pool) < 1

    def kernel(x, w):
        return cpu_gemm_bf16.xwt(x, w, few_tiles=tiles)
    bf16_rows = bound(BF16_ROWS, lambda m: ratio(kernel, other, xb[:m], pool))
    return CpuMatmul(fp32_rows, bf16_rows, widen, tiles)


def fp32_product(fp32_rows: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """x @ w^T in fp32 as worker.model.layers.linear computes it under an fp32 bound of fp32_rows."""
    return lambda x, w: cpu_gemm.xwt(x, w) if 0 < x.shape[0] <= fp32_rows else F.linear(x, w)


def up_to(rows: int) -> str:
    return "any number of" if rows >= ALL_ROWS else f"up to {rows}"


def choose_quantized(wanted: bool, shapes: tuple[tuple[int, int], ...], kind: str, again: bool = False,
                     vocab: bool = False, fp32_rows: int = 0) -> int:
    """The rows up to which a layer's projections, weights of `shapes` quantized as `kind`
    ("int8", "q8_0" or "q4_1"), run through their kernel (kernels/csrc/cpu_gemm_int8.c,
    cpu_gemm_gguf.c) on this machine; larger products dequantize the weights for an fp32 product
    (fp32_rows: choose()'s bound for it, which the race uses too). The race multiplies by every
    shape of the layer, as a step does: on a Zen 2 EPYC the Q4_1 panels lost 5-15% to the fp32
    kernel from 128 rows on the MLP's [1536, 576] alone and won on the layer's four (300 rows: 413
    against 434 ms). Measured at a machine's
    first start and kept, as choose()'s bounds are (where they cross is the machine's: about 64
    rows on an AVX-512 Xeon by bench/bench_gemm.py; 128 for Q4_1 and 64 for Q8_0 on a Zen 5 EPYC
    at stop 42, 16 for Q4_1 at stop 43); QUANTIZED_DEFAULT_ROWS with --cpu-matmul torch.
    vocab: the vocabulary projection (shapes: its one [vocab, hidden]), raced over VOCAB_ROWS:
    past its bound every call dequantizes the whole vocabulary, 28M weights for SmolLM2, about
    50 ms on a Zen 5 EPYC where the GGUF kernel takes 4 ms for 17 rows and 59 for 128, while a
    layer's small dequantized copy stays in cache (whose bound, 16 there, would send a step of
    17 sequences that way)."""
    module = cpu_gemm_int8 if kind == "int8" else cpu_gemm_gguf
    if not (wanted and module.available()):
        return QUANTIZED_DEFAULT_ROWS
    build = cbuild.library_path(module.SOURCE, module.FLAGS).name
    name, rows, field = (("vocab", VOCAB_ROWS, "vocab_kernel_rows") if vocab
                         else ("shape", QUANTIZED_ROWS, "kernel_rows"))
    started = time.perf_counter()
    found, was_kept = kept(CACHE_NAME, machine_key(f"{name}=" + ",".join(f"{n}x{k}" for n, k in shapes), kind,
                                                   build, f"fp32_rows={fp32_rows}", timed(rows), BOUND_RULE),
                           lambda: {field: measure_quantized(shapes, kind, vocab, fp32_rows)}, {field}, again)
    logger.info("%s %sprojections of %s rows run through %s (%s)", kind, "vocabulary " if vocab else "",
                up_to(found[field]), Path(module.SOURCE).name, how(was_kept, started))
    return found[field]


@dataclass(frozen=True)
class _Format:
    """A quantized format as the race uses it: a weight packed, its rows reordered, and the two
    ways to multiply by it (the kernel; torch's GEMM on the dequantized weights)."""
    pack: Callable[[torch.Tensor], Any]
    reorder: Callable[[Any, torch.Tensor], Any]
    kernel: Callable[[torch.Tensor, Any], torch.Tensor]
    dequantized: Callable[[torch.Tensor, Any], torch.Tensor]
    nbytes: Callable[[Any], int]


def _format(kind: str, fp32_rows: int) -> _Format:
    dense = fp32_product(fp32_rows)
    if kind == "int8":  # (int8 rows, a scale per row)
        return _Format(cpu_gemm_int8.quantize, lambda q, order: (q[0][order], q[1][order]),
                       lambda a, q: cpu_gemm_int8.xwt(a, *q),
                       lambda a, q: dense(a, cpu_gemm_int8.dequantize(*q)),
                       lambda q: q[0].numel())
    return _Format(lambda w: cpu_gemm_gguf.quantize(w, kind), lambda q, order: q[order],
                   lambda a, q: cpu_gemm_gguf.xwt(a, q, kind),
                   lambda a, q: dense(a, cpu_gemm_gguf.dequantize(q, kind)),
                   lambda q: q.numel())


def measure_quantized(shapes: tuple[tuple[int, int], ...], kind: str, vocab: bool = False,
                      fp32_rows: int = 0) -> int:
    """The kernel against an fp32 product on the dequantized weights (what a projection past the
    bound does), each call a product by every weight of a layer (`shapes`), on a pool of such
    layers, the first's rows in other orders (two for a vocabulary, whose dequantized copy alone
    is far past any cache, timed over fewer pairs)."""
    rows, pairs, most = (VOCAB_ROWS, VOCAB_PAIRS, 2) if vocab else (QUANTIZED_ROWS, PAIRS, MAX_POOL)
    fmt = _format(kind, fp32_rows)
    g = torch.Generator().manual_seed(0)
    first = [fmt.pack(torch.randn(*shape, generator=g)) for shape in shapes]
    count = max(2, min(most, POOL_BYTES // sum(fmt.nbytes(w) for w in first)))
    pool = [first] + [[fmt.reorder(w, torch.randperm(shape[0], generator=g)) for w, shape in zip(first, shapes)]
                      for _ in range(count - 1)]
    xs = {k: torch.randn(max(rows), k, generator=g) for _, k in shapes}  # x by in-features

    def layer(product):
        return lambda x, weights: [product(xs[k][:x.shape[0]], w) for (_, k), w in zip(shapes, weights)]

    return bound(rows, lambda m: ratio(layer(fmt.kernel), layer(fmt.dequantized), xs[shapes[0][1]][:m], pool, pairs),
                 beyond=not vocab)


def bound(rows: tuple[int, ...], ratio_at, beyond: bool = False) -> int:
    """The bound over `rows` (ascending) that saves the most: the kernel takes every row count up
    to it, where each saves 1 - ratio_at(m) (the kernel's time over BLAS's; negative where BLAS
    is faster), BLAS the rest; 0 where no prefix saves anything. A prefix sum rather than the
    first loss: one noisy tie among wins must not hand the larger products to BLAS. beyond: where
    the kernel won at the last row count, it takes larger products too (ALL_ROWS)."""
    best, best_saving, saving = 0, 0.0, 0.0
    for m in rows:
        saving += 1.0 - ratio_at(m)
        if saving > best_saving:
            best, best_saving = m, saving
    return ALL_ROWS if beyond and best == rows[-1] else best


def ratio(kernel, other, x: torch.Tensor, pool: list[torch.Tensor], pairs: int = PAIRS) -> float:
    """kernel's time over other's for x against the pool's weights: the median over at least
    `pairs` pairs of calls timed back to back (a VM's speed drifts by the second), each pair's two
    calls on two weights half the pool apart, so that neither reads what the other just brought
    into the cache. Products of up to STREAM_ROWS rows go round the whole pool, which no cache
    holds, so the weights come from memory as in a step; larger ones, bound by arithmetic, round
    a share of it (the timing stays short)."""
    weights = pool[:max(1, len(pool) * STREAM_ROWS // max(x.shape[0], STREAM_ROWS))]
    kernel(x, weights[0]), other(x, weights[0])  # first calls pay one-time costs
    ratios: list[float] = []
    while len(ratios) < max(pairs, len(weights)):
        for i, w in enumerate(weights):
            start = time.perf_counter()
            kernel(x, w)
            middle = time.perf_counter()
            other(x, weights[(i + len(weights) // 2) % len(weights)])
            ratios.append((middle - start) / max(time.perf_counter() - middle, 1e-9))
    return statistics.median(ratios)


def _pool_size(shape: tuple[int, int], itemsize: int) -> int:
    return max(1, min(MAX_POOL, POOL_BYTES // (shape[0] * shape[1] * itemsize)))
