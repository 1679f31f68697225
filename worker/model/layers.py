"""Building blocks of the Llama family, numerically matched to transformers' implementations.

On a CPU a decode step's activations are small ([num_seqs, hidden]), so each elementwise torch op
costs its dispatch and, with several threads, a parallel region, and each new tensor its
allocation: these blocks use as few ops and new tensors as give the same numbers.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8, cpu_pointwise
from worker.model import cpu_matmul
from worker.model.cpu_matmul import CpuMatmul


# How CPU projections are computed here, by dtype and rows (worker/model/cpu_matmul.py): chosen once
# at start-up by use_cpu_kernel, read by every projection.
CPU = CpuMatmul()


def use_cpu_kernel(wanted: bool, shape: tuple[int, int], dtype: torch.dtype,
                   again: bool = False) -> CpuMatmul:
    """--cpu-matmul auto (wanted) or torch: whether fp32 and bf16 CPU projections go through
    pagoda's kernels, and up to how many rows, for a `dtype` model whose MLP weight is [shape]
    (measured again, whatever was kept, with `again`: --measure-again)."""
    global CPU
    CPU = cpu_matmul.choose(wanted, shape, dtype, again)
    return CPU


def kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= CPU.fp32_kernel_rows
            and x.dtype == weight.dtype == torch.float32)


def bf16_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= CPU.bf16_kernel_rows
            and x.dtype == weight.dtype == torch.bfloat16)


def bf16_widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bf16 CPU projection the bf16 kernel does not take runs in fp32."""
    return CPU.bf16_widen and x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through kernels/csrc/cpu_gemm.c or cpu_gemm_bf16.c where they fit."""
    if kernel_fits(x, weight):
        out = cpu_gemm.xwt(x, weight)
    elif bf16_kernel_fits(x, weight):
        out = cpu_gemm_bf16.xwt(x, weight, few_tiles=CPU.bf16_few_rows_tiles)
    elif bf16_widens(x, weight):
        out = linear(x.float(), weight.float()).to(torch.bfloat16)
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out.add_(bias)


# Rows up to which an int8, Q8_0 or Q4_1 projection runs through its kernel
# (kernels/csrc/cpu_gemm_int8.c, cpu_gemm_gguf.c); above, the weights are dequantized (in C, one pass)
# for an fp32 product (linear above), as a prefill chunk is bound by arithmetic, not by weight bytes. The
# machine's, for the model's format, measured at start-up (use_quantized_kernel): on an AVX-512
# Xeon, one thread, SmolLM2's projections in Q4_1 took 97 ms through the kernel against 316
# dequantized into MKL with 16 rows, 446 against 463 with 64, 746 against 528 with 128; on a Zen
# 5 EPYC, two threads, 75 against 106 with 32 rows, 146 against 148 with 64, 290 against 235
# with 128. The vocabulary projection has its own (cpu_matmul.choose_quantized, vocab).
QUANTIZED_KERNEL_ROWS = cpu_matmul.QUANTIZED_DEFAULT_ROWS
QUANTIZED_VOCAB_KERNEL_ROWS = cpu_matmul.QUANTIZED_DEFAULT_ROWS


def use_quantized_kernel(wanted: bool, shapes: tuple[tuple[int, int], ...], kind: str, again: bool = False,
                         vocab_shape: tuple[int, int] | None = None) -> int:
    """Sets QUANTIZED_KERNEL_ROWS for a model quantized as `kind` whose layer's weights have
    `shapes` (out, in features), and QUANTIZED_VOCAB_KERNEL_ROWS for its [vocab_shape]
    vocabulary projection."""
    global QUANTIZED_KERNEL_ROWS, QUANTIZED_VOCAB_KERNEL_ROWS
    fp32_rows = CPU.fp32_kernel_rows  # use_cpu_kernel's, which products past the bound use
    QUANTIZED_KERNEL_ROWS = cpu_matmul.choose_quantized(wanted, shapes, kind, again, fp32_rows=fp32_rows)
    if vocab_shape is not None:
        QUANTIZED_VOCAB_KERNEL_ROWS = cpu_matmul.choose_quantized(wanted, (vocab_shape,), kind, again, vocab=True,
                                                                  fp32_rows=fp32_rows)
    return QUANTIZED_KERNEL_ROWS


def _quantized_kernel_fits(x: torch.Tensor, vocab: bool) -> bool:
    most = QUANTIZED_VOCAB_KERNEL_ROWS if vocab else QUANTIZED_KERNEL_ROWS
    return x.dim() == 2 and x.shape[0] <= most and x.dtype == torch.float32


def int8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, vocab: bool = False) -> torch.Tensor:
    """x @ (scale * w8)^T (+ bias), weight-only int8 (--quantization int8); vocab: the
    vocabulary projection, with its own bound."""
    if _quantized_kernel_fits(x, vocab) and cpu_gemm_int8.available():
        out = cpu_gemm_int8.xwt(x, w8, scale)
        return out if bias is None else out.add_(bias)
    return linear(x, cpu_gemm_int8.dequantize(w8, scale, x.dtype), bias)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str,
                bias: torch.Tensor | None = None, vocab: bool = False) -> torch.Tensor:
    """x @ W^T (+ bias), W as GGUF blocks of kind "q8_0" or "q4_1" (--quantization q8_0 / q4_1);
    vocab: the vocabulary projection, with its own bound."""
    if _quantized_kernel_fits(x, vocab) and cpu_gemm_gguf.available():
        out = cpu_gemm_gguf.xwt(x, blocks, kind)
        return out if bias is None else out.add_(bias)
    return linear(x, cpu_gemm_gguf.dequantize(blocks, kind, x.dtype), bias)


class Linear(nn.Linear):
    """nn.Linear through linear() above, or int8_linear() once quantize_int8() ran, or
    gguf_linear() once quantize_gguf() ran."""

    w8: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    blocks: torch.Tensor | None = None  # GGUF blocks of self.kind
    kind: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w8 is not None:
            return int8_linear(x, self.w8, self.scale, self.bias)
        if self.blocks is not None:
            return gguf_linear(x, self.blocks, self.kind, self.bias)
        return linear(x, self.weight, self.bias)

    def quantize_int8(self) -> None:
        """Per-output-channel int8 weights in place of the float ones, which are freed."""
        self.w8, self.scale = cpu_gemm_int8.quantize(self.weight)
        self.weight = None

    def quantize_gguf(self, kind: str, parts: list[tuple[int, torch.Tensor | None]]) -> None:
        """GGUF blocks of kind in place of the float weights, which are freed. parts: the rows in
        order (a fused projection's q, k, v or gate, up), each (count, its blocks as the file
        stores them, in this weight's row order) or (count, None): quantized here from its float
        rows with gguf's reference quantizer."""
        rows, start = [], 0
        for count, stored in parts:
            if stored is None:
                stored = cpu_gemm_gguf.quantize(self.weight[start:start + count], kind)
            elif stored.shape[0] != count or cpu_gemm_gguf.in_features(stored, kind) != self.in_features:
                raise ValueError(f"{kind} blocks {tuple(stored.shape)} for {count} rows of {self.in_features}")
            rows.append(stored)
            start += count
        if start != self.out_features:
            raise ValueError(f"{kind} parts of {start} rows for a weight of {self.out_features}")
        self.blocks, self.kind = torch.cat(rows).contiguous(), kind
        self.weight = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With residual: adds it into x in place and also returns the sum, the next layer's
        residual (vLLM's fused add + norm). x must be a fresh activation that nothing else holds,
        as the output of a projection is."""
        if cpu_pointwise.runs_on(x) and (residual is None or x.is_contiguous()):
            # One C call, rounding where the ops below round (its sums in another order).
            out = cpu_pointwise.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, x)
        if residual is not None:
            x = x.add_(residual)
        # HF's arithmetic (statistics in fp32, rounded to the dtype before the weight), with the
        # temporaries updated in place. (F.rms_norm is no help: on a CPU it runs the same ops.)
        h = x.float()
        rstd = h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        out = (h * rstd).to(x.dtype).mul_(self.weight)
        return out if residual is None else (out, x)


class RotaryEmbedding(nn.Module):
    """cos + i sin for every position up to max_positions, computed once; forward indexes them by
    the flat positions of the batch, so chunked prefill and decode need nothing special."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # Explicit devices everywhere: the model around this is built under torch.device("meta").
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device="cpu"), inv_freq)
        # A plain attribute, not a buffer: module-wide .to(dtype) must not touch it.
        self.cis = torch.complex(freqs.cos(), freqs.sin()).to(device)  # [max_positions, D / 2]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """cos + i sin [T, 1, D/2] for the batch's positions: looked up once per step, used by
        every layer."""
        return self.cis[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: queries and keys whose heads hold each rotated pair (i, i + D/2) of HF's
    rotate_half convention side by side, at (2i, 2i + 1), which is how LlamaForCausalLM loads
    q_proj and k_proj. Each pair is then a complex number and the rotation one product for all
    heads: the same multiplications and sums as HF's x * cos + rotate_half(x) * sin, so in fp32
    the same bits. Lower precisions rotate in fp32 and round once; bf16 on a CPU in one C call
    that turns x in place (x must be a fresh activation, as the qkv projection's output is)."""
    if cpu_pointwise.runs_on(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return cpu_pointwise.rotary_(x, cis)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3 (Llama 3.1): long wavelengths slowed by factor, short ones kept, a smooth ramp between;
    # the same formula as transformers' _compute_llama3_parameters.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class SiluAndMul(nn.Module):
    """The gated MLP activation over a fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_pointwise.runs_on(x):
            return cpu_pointwise.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
