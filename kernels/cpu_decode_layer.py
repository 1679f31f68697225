"""A whole decode step of a pre-norm transformer in one C call (kernels/csrc/cpu_decode_layer.c):
every layer (RMSNorm, q/k/v with rotary q and k, the K/V writes, paged attention, o, RMSNorm,
gated SiLU MLP, the residual sums) in one parallel region, over GGUF Q8_0 / Q4_1 weights, int8
rows with a scale per row (kernels/cpu_gemm_int8.py's format) or dense fp32 / bf16 ones, and an fp32 or bf16 paged cache, then the final norm; activations in
fp32. For a single stream, where layer-by-layer torch spends a large share of the step on its
ops' dispatch (worker/model/fused_decode.py decides when).

Shapes and layouts are kernels/cpu_attention.py's and kernels/cpu_gemm_gguf.py's; reference()
is the same step in float64 on the dequantized (or widened) weights, which the kernel is held
to. AVX-512F, else AVX2 + FMA (+ F16C), chosen at run time; else available() is False.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.kernels import cbuild, cpu_decode_attention, cpu_gemm_gguf, cpu_gemm_int8
from pagoda.kernels.cpu_kv_layout import key_blocks

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_decode_layer.c"
FLAGS = cbuild.EXP_KERNEL_FLAGS
ISA_NAMES = {2: "AVX-512F", 1: "AVX2+FMA"}
# Weight formats by their ggml type: GGUF blocks, or dense rows.
DENSE = {"f32": (0, torch.float32), "bf16": (30, torch.bfloat16)}
INT8 = "int8"  # int8 rows (ggml's I8) with a scale per row (LayerWeights.scales)
INT8_WTYPE = 24
# The step with bf16 dot products against reference(bf16_dot=True), relative: both round the same
# activations to bf16, but one within fp32's error of a rounding boundary can round the other way
# (a bf16 step, 2^-8), which the next layers carry (measured up to 5e-3; 2e-7 where none did).
BF16_DOT_TOL = 1e-2
# Tokens from which a bf16 step takes the best products the CPU has (AMX tiles, else dot
# products). With fewer it takes the widened weights, one row at a time, or where few_rows_dot
# says so the dot products: on a Zen 5 EPYC the widened weights streamed as fast or faster (1
# token: 7.5 against 8.5 ms; 4: even; 8: 21 against 13) and keep the activations in fp32; on an
# AMX Xeon the dot products won from one token (11.8 against 14.7 ms; 4: 18.5 against 25.2) and
# the tiles from 8 (20.2 against 22.6; 16: 27.6 against 37.5; at 1 and 2 tokens the tiles, 16
# rows padded, lost: 13.2 and 16.0 against 11.8 and 15.2).
BF16_DOT_MIN_TOKENS = 5
few_rows_dot = False  # the machine's, measured at start-up (worker/startup/measurements.py)
WTYPES = {**{kind: fmt[0] for kind, fmt in cpu_gemm_gguf.FORMATS.items()}, **{k: t for k, (t, _) in DENSE.items()},
          INT8: INT8_WTYPE}
PROJECTIONS = ("qkv", "o", "gate_up", "down")

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class DecodeLayer(ctypes.Structure):
    _fields_ = [("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p),
                ("ld_qkv", ctypes.c_int64), ("ld_o", ctypes.c_int64), ("ld_gate_up", ctypes.c_int64),
                ("ld_down", ctypes.c_int64), ("norm1", _p), ("norm2", _p), ("k_cache", _p), ("v_cache", _p),
                ("scale_qkv", _p), ("scale_o", _p), ("scale_gate_up", _p), ("scale_down", _p)]


class DecodeStep(ctypes.Structure):
    _fields_ = [("T", _i), ("H", _i), ("Hq", _i), ("Hkv", _i), ("D", _i), ("I", _i), ("bs", _i),
                ("wtype", _i), ("cache_dtype", _i), ("num_rows", _i), ("threads", _i), ("isa", _i),
                ("eps", _f), ("scale", _f), ("cis", _p), ("positions", _p), ("slots", _p),
                ("rows", _p), ("lens", _p), ("tables", _p), ("ldt", ctypes.c_int64),
                ("final_norm", _p), ("h", _p), ("out", _p), ("bf16_dot", _i), ("prefetch", _i)]


_kernel = cbuild.IsaKernel(SOURCE, FLAGS, "pagoda_decode_layer_isa", "pagoda_decode_step",
                           [_p, _i, ctypes.POINTER(DecodeStep)], ISA_NAMES, "decoding layer by layer in torch")
available, isa, supported_isas = _kernel.available, _kernel.isa, _kernel.supported_isas


@dataclass
class LayerWeights:
    """One layer as the kernel reads it: the fused q|k|v rows (q and k rows paired for the
    rotary turn), o, the fused gate|up rows and down, each GGUF blocks (uint8 [N, K / 32 *
    bytes]), int8 rows [N, K] or dense rows (fp32 or bf16 [N, K]); the two norms' weights (fp32
    [H]); for int8 rows, each projection's scales (fp32 [N], in PROJECTIONS' order)."""
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm1: torch.Tensor
    norm2: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    kind: str                   # "q8_0", "q4_1" (GGUF blocks), "f32" or "bf16" (dense rows)


def layer_weights(projections: list[torch.Tensor], norm1: torch.Tensor, norm2: torch.Tensor,
                  kind: str) -> LayerWeights:
    """A layer of float weights ([N, K] each, in PROJECTIONS' order) as the kernel reads it in
    `kind`: GGUF blocks by gguf's quantizer, int8 rows and scales, or dense rows of its dtype."""
    if kind == INT8:
        rows, scales = zip(*(cpu_gemm_int8.quantize(w) for w in projections))
        return LayerWeights(*rows, norm1, norm2, scales=tuple(scales))
    if kind in DENSE:
        return LayerWeights(*(w.to(DENSE[kind][1]) for w in projections), norm1, norm2)
    return LayerWeights(*(cpu_gemm_gguf.quantize(w, kind) for w in projections), norm1, norm2)


def layers_array(weights: list[LayerWeights], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The ctypes array the kernel walks; it holds raw pointers, so the caller keeps weights and
    caches alive (and rebuilds it if a cache is reallocated)."""
    arr = (DecodeLayer * len(weights))()
    for a, w, (k, v) in zip(arr, weights, kv_caches):
        for i, name in enumerate(PROJECTIONS):
            rows = getattr(w, name)
            if rows.dtype not in (torch.uint8, torch.int8, torch.float32, torch.bfloat16) or not rows.is_contiguous():
                raise ValueError(f"{name}: contiguous GGUF blocks (uint8), int8, fp32 or bf16 rows expected")
            if (rows.dtype == torch.int8) != (w.scales is not None):
                raise ValueError(f"{name}: int8 rows come with their scales, and only they")
            setattr(a, name, rows.data_ptr())
            setattr(a, f"ld_{name}", rows.stride(0) * rows.element_size())  # bytes
            if w.scales is not None:
                scale = w.scales[i]
                if scale.dtype != torch.float32 or not scale.is_contiguous() or scale.numel() != rows.shape[0]:
                    raise ValueError(f"{name}: a contiguous fp32 scale per row expected")
                setattr(a, f"scale_{name}", scale.data_ptr())
        a.norm1, a.norm2 = w.norm1.data_ptr(), w.norm2.data_ptr()
        a.k_cache, a.v_cache = k.data_ptr(), v.data_ptr()
    return arr


@functools.cache  # the CPU's, asked once (a bf16 step of 5 or more tokens asked at each step)
def bf16_dot_here() -> int:
    """The products decode steps over bf16 weights may take here on activations rounded to bf16:
    2 AMX tiles (or AVX512-BF16 dot products), 1 AVX512-BF16 dot products only, 0 neither (widened
    weights against fp32 activations). Call only after available()."""
    return int(_kernel.function("pagoda_decode_layer_bf16_dot", [], _i)())


def bf16_modes_here() -> list[int]:
    """Every bf16_dot a bf16 step may take here: 0 (widened), then each product this CPU has."""
    return list(range(bf16_dot_here() + 1))


def decode_step(layers, shape: Shape, final_norm: torch.Tensor, h: torch.Tensor, cis: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                tables: torch.Tensor, k_cache: torch.Tensor, isa: int | None = None,
                bf16_dot: int | None = None) -> torch.Tensor:
    """The final-normed hidden states [T, H] of the step. h: the embeddings [T, H] (fp32,
    contiguous; summed into in place: the residual stream). cis: complex64 [positions, D / 2].
    positions, slots: int64 [T]; rows, lens: int32 [R]; tables: int32 [R, blocks] (the decode
    plan's, every token a row). k_cache: any layer's (for its layout and dtype). bf16_dot: bf16
    weights' products on activations rounded to bf16, as torch's bf16 model rounds them: 1
    AVX512-BF16 dot products, 2 AMX tiles, True the best this CPU has, 0 widened weights (None:
    the best from BF16_DOT_MIN_TOKENS tokens, dot products or widened
    weights below, as few_rows_dot says). Call only after available(), with bounds already
    checked (C checks none)."""
    if bf16_dot is None:
        here = bf16_dot_here()
        bf16_dot = here if h.shape[0] >= BF16_DOT_MIN_TOKENS else min(here, 1) if few_rows_dot else 0
    elif bf16_dot is True:
        bf16_dot = bf16_dot_here()
    T = h.shape[0]
    out = torch.empty_like(h)
    num_blocks, bs, num_kv_heads, head_dim = k_cache.shape
    p = DecodeStep(T=T, H=shape.hidden, Hq=shape.num_heads, Hkv=shape.num_kv_heads, D=shape.head_dim,
                   I=shape.intermediate, bs=bs, wtype=WTYPES[shape.kind],
                   cache_dtype=cpu_decode_attention.DTYPES[k_cache.dtype], num_rows=rows.numel(),
                   threads=torch.get_num_threads(), isa=isa or _kernel.best, eps=shape.eps,
                   scale=shape.head_dim ** -0.5, cis=cis.data_ptr(), positions=positions.data_ptr(),
                   slots=slots.data_ptr(), rows=rows.data_ptr(), lens=lens.data_ptr(),
                   tables=tables.data_ptr(), ldt=tables.stride(0), final_norm=final_norm.data_ptr(),
                   h=h.data_ptr(), out=out.data_ptr(), bf16_dot=int(bf16_dot) if shape.kind == "bf16" else 0,
                   prefetch=int(cpu_decode_attention.prefetch))
    _kernel.fn(ctypes.addressof(layers), len(layers), ctypes.byref(p))
    return out


def reference(weights: list[LayerWeights], shape: Shape, final_norm: torch.Tensor, h: torch.Tensor,
              cis: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lens: torch.Tensor,
              tables: torch.Tensor, bf16_dot: bool = False) -> torch.Tensor:
    """decode_step in float64 (each token t a decode row over lens[t] positions of tables[t]),
    on the dequantized (or widened) weights, each projection's input rounded to bf16 first with
    bf16_dot; writes the step's K/V into the caches, rounded to their dtype, as the kernel does.
    Returns float64 [T, H]."""
    T, D = h.shape[0], shape.head_dim
    Hq, Hkv = shape.num_heads, shape.num_kv_heads
    x = h.double()
    c = torch.view_as_real(cis[positions]).double()  # [T, D / 2, 2]

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + shape.eps) * w.double()

    def mm(v, rows, scale):
        if shape.kind == INT8:
            return v @ (rows.double() * scale.double()[:, None]).t()
        if shape.kind in DENSE:
            if bf16_dot and shape.kind == "bf16":
                v = v.float().bfloat16().double()  # the kernel rounds its fp32 activations
            return v @ rows.double().t()
        return v @ cpu_gemm_gguf.dequantize(rows, shape.kind, torch.float64).t()

    def turn(v):  # [T, heads, D], pairs (2i, 2i + 1)
        a, b = v[..., 0::2], v[..., 1::2]
        cos, sin = c[:, None, :, 0], c[:, None, :, 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)

    for w, (k_cache, v_cache) in zip(weights, kv_caches):
        sq, so, sgu, sd = w.scales or (None,) * 4
        qkv = mm(norm(x, w.norm1), w.qkv, sq)
        q = turn(qkv[:, :Hq * D].view(T, Hq, D))
        k = turn(qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D))
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        bs = k_cache.shape[1]
        keys = key_blocks(k_cache)  # [blocks, Hkv, D, bs]: the layout the kernels read
        for t in range(T):
            if slots[t] >= 0:
                keys[slots[t] // bs, :, :, slots[t] % bs] = k[t].to(k_cache.dtype)
                v_cache[slots[t] // bs, slots[t] % bs] = v[t].to(v_cache.dtype)
        attn = torch.empty(T, Hq, D, dtype=torch.float64)
        for t in range(T):
            n = int(lens[t])
            blocks = tables[t, :-(-n // bs)].long()
            kt = keys[blocks].permute(0, 3, 1, 2).reshape(-1, Hkv, D)[:n].double().repeat_interleave(Hq // Hkv, 1)
            vt = v_cache[blocks].reshape(-1, Hkv, D)[:n].double().repeat_interleave(Hq // Hkv, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[t], kt) * D ** -0.5, -1)
            attn[t] = torch.einsum("hn,nhd->hd", p, vt)
        x = x + mm(attn.reshape(T, -1), w.o, so)
        gu = mm(norm(x, w.norm2), w.gate_up, sgu)
        gate, up = gu.chunk(2, -1)
        x = x + mm(torch.nn.functional.silu(gate) * up, w.down, sd)
    return norm(x, final_norm)


@functools.cache
def agrees_with_reference(kind: str = "q4_1") -> bool:
    """Whether the best path here agrees with reference() on a small random step (two sequences,
    one token each, two layers): checked once a process before a model takes the kernel; one
    log line if not."""
    g = torch.Generator().manual_seed(0)
    shape = Shape(64, 4, 2, 16, 96, 1e-5, kind)

    def w(n, k):
        return torch.randn(n, k, generator=g) * k ** -0.5
    weights = [layer_weights([w(128, 64), w(64, 64), w(192, 64), w(64, 96)], 1 + 0.1 * torch.randn(64, generator=g),
                             1 + 0.1 * torch.randn(64, generator=g), kind)
               for _ in range(2)]
    caches = [(torch.randn(4, 16, 2, 16, generator=g), torch.randn(4, 16, 2, 16, generator=g)) for _ in range(2)]
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    h, final_norm = torch.randn(2, 64, generator=g), 1 + 0.1 * torch.randn(64, generator=g)
    angles = torch.outer(torch.arange(64.0), 10000.0 ** (-torch.arange(0, 16, 2) / 16))
    cis = torch.polar(torch.ones_like(angles), angles)
    positions, slots = torch.tensor([5, 20]), torch.tensor([5, 3 * 16 + 4])
    lens, tables = torch.tensor([6, 21], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    dot = kind == "bf16" and bf16_dot_here()
    want = reference(weights, shape, final_norm, h, cis, positions, slots, ref_caches, lens, tables, dot)
    got = decode_step(layers_array(weights, caches), shape, final_norm, h.clone(), cis, positions, slots,
                      torch.arange(2, dtype=torch.int32), lens, tables, caches[0][0], bf16_dot=dot)
    ok = bool(((got.double() - want).abs() <= (BF16_DOT_TOL if dot else 1e-4) * want.abs().clamp(min=1)).all())
    if not ok:
        logging.getLogger(__name__).warning(
            "the decode step kernel (%s) disagrees with float64 on this machine: it is off", isa())
    return ok
