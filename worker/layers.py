"""Building blocks of the Llama family, numerically matched to transformers' implementations."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With residual: adds it first and also returns the sum, the next layer's residual
        (vLLM's fused add + norm, which saves one pass over the activations)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        # Statistics in fp32 even for bf16 activations, cast back before the weight as HF does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_positions, computed once; forward indexes them by
    the flat positions of the batch, so chunked prefill and decode need nothing special."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # Explicit devices everywhere: the model around this is built under torch.device("meta").
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device="cpu"), inv_freq)
        # Plain attributes, not buffers: module-wide .to(dtype) must not round them to bf16.
        self.cos = freqs.cos().to(device)  # [max_positions, head_dim / 2], fp32
        self.sin = freqs.sin().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the batch's positions: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D]: rotate halves (i, i + D/2), HF's rotate_half convention."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
