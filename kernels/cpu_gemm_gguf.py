"""GGUF's block formats on the CPU (kernels/csrc/cpu_gemm_gguf.c): x (fp32) @ W^T with W stored as
Q8_0 or Q4_1 blocks of 32 weights along each row, byte for byte as in a .gguf file
(--quantization q8_0 / q4_1). For decode steps, which read every weight once per step: 1.06 and
0.63 bytes a weight against fp32's 4.

A weight is a uint8 tensor [N, K / 32 * block bytes], each row its blocks in order (gguf's own
"byte shape"). quantize() is gguf's reference quantizer (gguf.quants.quantize, bit-exact with
ggml-quants.c), so a tensor quantized here equals one llama.cpp would write; dequantize() is the
format (Q8_0: d * q, Q4_1: d * q + m, fp16 d and m). reference() is the product in float64 on
the dequantized weights, which the kernel is held to. The path is chosen at run time, the best
this CPU runs: AVX-512F or AVX2 + FMA with exact fp32 activations, or with int8_activations
AVX-512 VNNI or AVX2 with x quantized per block of 32 (INT8_ISAS, as llama.cpp does;
quantize_activations() is that rounding, and the reference for those paths multiplies the
rounded x); all need F16C. Else none (available() is False and the caller multiplies the
dequantized weights with torch).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from pagoda.kernels import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_gemm_gguf.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_NAMES = {4: "AVX-512 VNNI int8", 3: "AVX-512F", 2: "AVX2 int8", 1: "AVX2+FMA"}
INT8_ISAS = (4, 2)  # the paths that quantize x
BLOCK = 32
# --quantization name -> (ggml type number, bytes a block): gguf.GGMLQuantizationType's values.
FORMATS = {"q8_0": (8, 34), "q4_1": (3, 20)}

_kernel = cbuild.IsaKernel(
    SOURCE, FLAGS, "pagoda_gguf_isa", "pagoda_gguf_xwt",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
     ctypes.c_int],
    ISA_NAMES, "multiplying dequantized weights")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


# Whether xwt may take an int8 path (llama.cpp's way with these formats). Off: on SmolLM2 it
# keeps the float64 reference's greedy tokens on 4 (Q8_0) and 6 (Q4_1) of 8 prompts over 64
# tokens, under issue 26's bar of 7, for a decode step 5-15% faster (bench/quantized_accuracy.py,
# bench/bench_gemm.py; docs/benchmarks.md). The exact fp32 paths keep all 8.
int8_activations = False


def best_isa() -> int:
    """The path xwt takes unless told (0 where none runs)."""
    if not available():
        return 0
    if int8_activations:
        return _kernel.best
    return _best_exact()


@functools.cache
def _best_exact() -> int:
    return max(i for i in supported_isas() if i not in INT8_ISAS)


def ggml_type(kind: str):
    import gguf
    return gguf.GGMLQuantizationType(FORMATS[kind][0])


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The blocks (uint8 [N, K / 32 * bytes]) of a float weight [N, K], K a multiple of 32."""
    from gguf.quants import quantize as gguf_quantize
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{kind}: rows of {w.shape[-1]} weights are not whole blocks of {BLOCK}")
    arr = w.detach().to(torch.float32).cpu().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(arr, ggml_type(kind))))


def in_features(blocks: torch.Tensor, kind: str) -> int:
    return blocks.shape[-1] // FORMATS[kind][1] * BLOCK


def dequantize(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] weights of their blocks: through the C library where it runs (one pass), else torch.
    In float64 it is exact, which is what the float64 references use."""
    if dtype == torch.float64 or not available():
        return dequantize_torch(blocks, kind, dtype)
    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], in_features(blocks, kind), dtype=torch.float32)
    if out.numel():
        fn = _kernel.function("pagoda_gguf_dequantize", _DEQUANTIZE_ARGS)
        fn(blocks.data_ptr(), blocks.stride(0), FORMATS[kind][0], out.data_ptr(),
           out.shape[0], out.shape[1], torch.get_num_threads())
    return out.to(dtype)


def dequantize_torch(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    nbytes = FORMATS[kind][1]
    b = blocks.reshape(blocks.shape[0], -1, nbytes)  # [N, blocks, bytes]
    work = torch.float64 if dtype == torch.float64 else torch.float32
    d = b[..., 0:2].contiguous().view(torch.float16).to(work)  # [N, blocks, 1]
    if kind == "q8_0":
        w = b[..., 2:].view(torch.int8).to(work) * d
    else:
        m = b[..., 2:4].contiguous().view(torch.float16).to(work)
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(work)  # low nibbles first: weights 0-15, then 16-31
        w = torch.addcmul(m, q, d)
    return w.reshape(blocks.shape[0], -1).to(dtype)


_DEQUANTIZE_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_int64, ctypes.c_int]
_QUANTIZE_X_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]


def xwt(x: torch.Tensor, blocks: torch.Tensor, kind: str, isa: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W^T, W [N, K] as blocks -> [M, N] fp32. Call only after available()."""
    M, K = x.shape
    N = blocks.shape[0]
    if K != in_features(blocks, kind):
        raise ValueError(f"x has {K} columns, the {kind} weights {in_features(blocks, kind)}")
    x, blocks = cbuild.row_major(x, blocks)
    out = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        _kernel.fn(x.data_ptr(), x.stride(0), blocks.data_ptr(), blocks.stride(0), FORMATS[kind][0],
                   out.data_ptr(), N, M, N, K, torch.get_num_threads(), isa or best_isa())
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 paths' x: per block of 32 values, d = max |x| / 127 and q = round(x / d) (half to
    even), in fp32 -> (q int8 [M, K], d [M, K / 32], s = d * sum(q) [M, K / 32]), by the kernel's
    own C function."""
    M, K = x.shape
    x = cbuild.row_major(x, x)[0]
    q = torch.empty(M, K, dtype=torch.int8)
    ds = torch.empty(M, K // BLOCK, 2, dtype=torch.float32)
    fn = _kernel.function("pagoda_gguf_quantize_x", _QUANTIZE_X_ARGS)
    fn(x.data_ptr(), x.stride(0), M, K, q.data_ptr(), ds.data_ptr())
    return q, ds[..., 0], ds[..., 1]


def reference(x: torch.Tensor, blocks: torch.Tensor, kind: str, isa: int | None = None) -> torch.Tensor:
    """The product in float64 on the dequantized weights; for an int8 path (isa in INT8_ISAS), of
    x as that path rounds it."""
    return as_seen(x, isa).double() @ dequantize(blocks, kind, torch.float64).t()


def as_seen(x: torch.Tensor, isa: int | None) -> torch.Tensor:
    """x as the path multiplies it: rounded per block of 32 on an int8 path, else as it is."""
    if isa not in INT8_ISAS:
        return x
    q, d, _ = quantize_activations(x)
    return (q.double().view(*d.shape, BLOCK) * d.double()[..., None]).view(x.shape)


def agrees_with_reference() -> bool:
    """The path xwt takes, and the C dequantizer, against float64 on a small random product of
    each format (the start-up check)."""
    from pagoda.kernels.reference import matmul_within
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * BLOCK, generator=g)
    for kind in FORMATS:
        blocks = quantize(torch.randn(37, 4 * BLOCK, generator=g), kind)
        w = dequantize(blocks, kind, torch.float64)
        if not (matmul_within(xwt(x, blocks, kind), as_seen(x, best_isa()), w, 1e-5)
                and ((dequantize(blocks, kind).double() - w).abs() <= 1e-6 * w.abs() + 1e-7).all()):
            return False
    return True


_kernel.check = agrees_with_reference
