"""Weights from a .gguf file or a HF directory, as one dict of HF-named float tensors.

A GGUF file is dequantized once and cached as a HF directory (config.json + model.safetensors)
under modelfiles.resolve.cache_dir(path, "weights"); later starts memory-map that instead.
gguf_blocks() reads a GGUF's tensors as their quantized blocks instead (--quantization q8_0 /
q4_1 keeps those stored in its format as they are), cached the same way (BLOCKS_NAME).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from modelfiles.resolve import cache_dir
from worker.model.config import WEIGHTS_CACHE_NAME as CACHE_NAME, ModelConfig

logger = logging.getLogger(__name__)

CACHE_FILE = "model.safetensors"
# gguf_blocks' cache, one folder a format: reading a GGUF's tensor list means parsing all of its
# metadata (SmolLM2's 49,152 tokens and 48,900 merges), 3.7 s of every --quantization q4_1 start.
BLOCKS_NAME = "blocks-v1"
BLOCKS_FILE = "blocks.safetensors"

# GGUF name (after blk.N.) -> HF name (after model.layers.N.).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def load_weights(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json")
    cached = cache_dir(path, CACHE_NAME)
    if (cached / "config.json").exists() and (cached / CACHE_FILE).exists():
        return load_hf_dir(cached)
    config, weights = load_gguf(path)
    _save_cache(cached, config, weights)
    return config, weights


def load_hf_dir(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    start = time.perf_counter()
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (only safetensors are loaded)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    logger.info("loaded %d tensors from %s in %.2fs", len(weights), folder, time.perf_counter() - start)
    return config, weights


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    start = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_gguf(reader)
    # llama.cpp's converter interleaves the rows of q/k for its rope layout (pairs (2i, 2i+1)); HF
    # rotates halves (i, i + d/2). Qwen2 is stored unpermuted because llama.cpp uses NEOX rope there.
    permuted = config.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    # The first start converts the GGUF (tens of seconds on a small CPU); later ones read the cache.
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=None):
        name = _hf_name(t.name)
        arr = dequantize(t.data, t.tensor_type)
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        if permuted and ".q_proj." in name:
            arr = _unpermute(arr, config.num_heads)
        elif permuted and ".k_proj." in name:
            arr = _unpermute(arr, config.num_kv_heads)
        arr = np.asarray(arr, dtype=np.float32)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr).copy()
        weights[name] = torch.from_numpy(arr)
    logger.info("dequantized %d tensors from %s in %.2fs", len(weights), path, time.perf_counter() - start)
    return config, weights


def gguf_blocks(path: Path, kind: str) -> dict[str, torch.Tensor]:
    """--quantization q8_0 / q4_1: the tensors a .gguf file stores in that format, as their own
    blocks (uint8 [rows, bytes a row], kernels/cpu_gemm_gguf.py), HF-named and in HF's row order
    (q/k rows unpermuted like load_gguf's floats; a block never spans rows, so this moves whole
    rows of blocks). These are used as they are, not requantized from their dequantized floats,
    which could round to other blocks. A HF directory stores none: {}. Read from the file once,
    then from its cache."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir() or path.suffix != ".gguf":
        return {}
    cached = cache_dir(path, f"{BLOCKS_NAME}-{kind}") / BLOCKS_FILE
    if cached.exists():
        blocks = load_file(cached)
        logger.info("%d tensors of %s stored as %s (cached in %s)", len(blocks), path.name, kind, cached.parent)
        return blocks
    blocks = _read_gguf_blocks(path, kind)
    _write_by_rename(cached, lambda tmp: _save_tensors(blocks, tmp))
    return blocks


def _read_gguf_blocks(path: Path, kind: str) -> dict[str, torch.Tensor]:
    import gguf
    from pagoda.kernels.cpu_gemm_gguf import ggml_type

    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_gguf(reader)
    permuted = config.architecture in ("llama", "mistral")
    blocks: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.tensor_type != ggml_type(kind) or len(t.shape) != 2:
            continue
        name = _hf_name(t.name)
        arr = np.asarray(t.data)  # [rows, bytes a row], memory-mapped
        if permuted and ".q_proj." in name:
            arr = _unpermute(arr, config.num_heads)
        elif permuted and ".k_proj." in name:
            arr = _unpermute(arr, config.num_kv_heads)
        blocks[name] = torch.from_numpy(np.ascontiguousarray(arr).copy())
    logger.info("%d tensors of %s stored as %s", len(blocks), path.name, kind)
    return blocks


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): rows (head, pair, 2) back to (head, 2, pair)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_cache(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write the safetensors first and config.json last, each by rename, so that a reader that
    sees config.json sees a whole file even if two workers convert at once."""
    start = time.perf_counter()
    if not (_write_by_rename(folder / CACHE_FILE, lambda tmp: _save_tensors(weights, tmp))
            and _write_by_rename(folder / "config.json",
                                 lambda tmp: tmp.write_text(json.dumps(config.to_hf_config(), indent=2)))):
        return
    logger.info("cached dequantized weights in %s (%.2fs)", folder, time.perf_counter() - start)


def _save_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write_by_rename(file: Path, write) -> bool:
    """write(tmp), then tmp renamed to file: a worker starting beside this one reads a whole file
    or none. A read-only or full disk only costs the next start the conversion (False)."""
    from safetensors import SafetensorError  # how safetensors reports an I/O error (not OSError)

    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, file)
        return True
    except (OSError, SafetensorError) as e:
        logger.warning("could not cache %s in %s: %s", file.name, file.parent, e)
        return False
    finally:  # also when a signal interrupts the write
        tmp.unlink(missing_ok=True)
