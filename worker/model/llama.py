"""The Llama family (Llama, Mistral, Qwen2) over a flattened, unpadded batch with a paged KV cache.

All sequences' new tokens are concatenated into one [T] batch; only attention needs to know where
one sequence ends (AttentionMetadata). q/k/v and gate/up are fused into one matmul each, which
matters on a CPU where every extra small GEMM costs a dispatch and a pass over the activations.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.model.attention_backends import AttentionBackend
from worker.model.attention import PagedAttention
from worker.model.attention_metadata import AttentionMetadata
from worker.model.fused_decode import FusedDecode
from worker.model.config import ModelConfig
from pagoda.kernels import cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8
from worker.model import layers
from worker.model.layers import (Linear, RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary, bf16_kernel_fits,
                           bf16_widens, gguf_linear, int8_linear, kernel_fits, linear)
from worker.parallel.tensor_parallel import TensorParallel, row_parallel_linear

KVCache = tuple[torch.Tensor, torch.Tensor]

# Vocabulary rows per slice of the CPU logits product (1024 x 576 fp32 weights: 2.4 MB).
_VOCAB_SLICE = 1024

# HF checkpoint name -> (fused parameter, shard index); the fused weight is the shards concatenated.
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Fused parameter -> its HF shards in order.
_SHARDS = {fused: [n for n, (f, _) in sorted(_PACKED.items(), key=lambda kv: kv[1][1]) if f == fused]
           for fused, _ in _PACKED.values()}


class LlamaAttention(nn.Module):
    """With tensor parallelism, config holds this rank's heads and o_proj sums over ranks."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, config.o_proj_bias, tp)
        self.attn = PagedAttention(backend, self.head_dim ** -0.5)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        # q and k heads side by side in qkv: one rotary call turns both.
        qk = apply_rotary(qkv[:, :qk_size].view(T, -1, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(T, self.q_size))


def projection_shapes(config: ModelConfig) -> tuple[tuple[int, int], ...]:
    """A layer's projection weights (out, in features) as built here: q|k|v fused, o, gate|up
    fused, down (worker/model/cpu_matmul.py races the quantized kernels on them)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return (q + 2 * kv, h), (h, q), (2 * i, h), (h, i)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.shard_sizes = [config.intermediate_size, config.intermediate_size]
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = row_parallel_linear(config.intermediate_size, config.hidden_size,
                                             config.mlp_bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, rope, x, residual, kv_cache, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.rotary = rotary
        # Given its (meta) weight, so that it skips reset_parameters: normal_ on meta tensors
        # imports torch._dynamo, 3 s of the worker's start-up.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, tp)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    fused_decode = None  # worker/model/fused_decode.py's FusedDecode, once the weights qualify

    def forward(self, input_ids, positions, meta, kv_caches):
        x, residual = self.embed_tokens(input_ids), None
        if self.fused_decode is not None:
            out = self.fused_decode.forward(x, positions, meta, kv_caches)
            if out is not None:
                return out
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device, tp: TensorParallel | None = None) -> None:
        """config: the shape of this rank's share (worker/parallel/tensor_parallel.py shard_config) under tp."""
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        # Its cos/sin tables are plain tensors on the real device, so that building the rest on
        # "meta" and casting it to bf16 leaves them alone, in fp32.
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                 config.rope_scaling, device=device)
        self.model = LlamaModel(config, backend, rotary, self.tp)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    lm_head_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (w8, scale): quantize_int8

    def quantize_int8(self) -> int:
        """--quantization int8: every projection's weights, and the vocabulary projection's (a
        copy when tied: the embedding lookup keeps its float rows), per output channel. Returns
        the bytes the weights take now."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()
        head = self._head_weight()
        self.lm_head_int8 = cpu_gemm_int8.quantize(head)
        if not self.config.tie_word_embeddings:
            del self.lm_head
        self.model.fused_decode = FusedDecode.build(self)
        return sum(t.numel() * t.element_size() for t in (*self.state_dict().values(), *self.lm_head_int8)) + \
            sum(m.w8.numel() + 4 * m.scale.numel() for m in self.modules() if isinstance(m, Linear))

    lm_head_gguf: tuple[torch.Tensor, str] | None = None  # (blocks, kind): quantize_gguf

    def quantize(self, kind: str, model_path) -> int:
        """--quantization kind; returns the bytes the weights take now. For q8_0 / q4_1 a GGUF
        file's tensors already stored in that format are used as they are (the loader reads
        their blocks), the others are quantized from the float weights."""
        if kind == "int8":
            return self.quantize_int8()
        from worker.model.loader import gguf_blocks
        return self.quantize_gguf(kind, gguf_blocks(model_path, kind))

    def quantize_gguf(self, kind: str, stored: dict[str, torch.Tensor]) -> int:
        """Every projection's weights, and the vocabulary projection's (a copy when tied: the
        embedding lookup keeps its float rows), as GGUF blocks of kind ("q8_0", "q4_1"). stored:
        HF tensor name -> its blocks in that format (worker/model/loader.py gguf_blocks), taken as they
        are; every other weight is quantized with gguf's reference quantizer."""
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            owner, _, leaf = name.rpartition(".")
            if leaf not in _SHARDS:
                module.quantize_gguf(kind, [(module.out_features, stored.get(f"{name}.weight"))])
                continue
            parts = []
            for i, (shard, rows) in enumerate(zip(_SHARDS[leaf], self.get_submodule(owner).shard_sizes)):
                blocks = stored.get(f"{owner}.{shard}.weight")
                if blocks is not None and leaf == "qkv_proj" and i < 2:  # load_weights' row order
                    blocks = blocks[_pair_rotary_halves(torch.arange(rows), self.config.head_dim)]
                parts.append((rows, blocks))
            module.quantize_gguf(kind, parts)
        tied = self.config.tie_word_embeddings
        name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        blocks = stored.get(name)
        if blocks is None:
            head = self.model.embed_tokens.weight if tied else self.lm_head.weight
            blocks = cpu_gemm_gguf.quantize(head, kind)
        self.lm_head_gguf = (blocks.contiguous(), kind)
        if not tied:
            del self.lm_head
        self.model.fused_decode = FusedDecode.build(self)
        return sum(t.numel() * t.element_size() for t in self.state_dict().values()) + blocks.numel() + \
            sum(m.blocks.numel() for m in self.modules() if isinstance(m, Linear))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only for the rows that sample: the vocab projection is the largest matmul per token."""
        if self.lm_head_int8 is not None:
            return int8_linear(hidden, *self.lm_head_int8, vocab=True).float()
        if self.lm_head_gguf is not None:
            return gguf_linear(hidden, *self.lm_head_gguf, vocab=True).float()
        weight = self._head_weight()
        if (hidden.device.type != "cpu" or kernel_fits(hidden, weight) or bf16_kernel_fits(hidden, weight)
                or bf16_widens(hidden, weight)):
            return linear(hidden, weight).float()
        # Without pagoda's kernel, on a CPU one [rows, hidden] x [hidden, vocab] product runs at a third to a half of the
        # GEMM rate of the layers' (BLAS blocks it badly for so wide an output); the same product
        # in slices of the vocabulary, each written in place into its columns, runs near that
        # rate (tests/unit/worker/test_worker_layers.py holds it to a float64 product).
        logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], _VOCAB_SLICE):
            torch.mm(hidden, weight[start:start + _VOCAB_SLICE].t(),
                     out=logits[:, start:start + _VOCAB_SLICE])
        return logits.float()

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's max of compute_logits (the first of tied maxima, the first NaN), int64 [rows],
        where pagoda's bf16 kernel computes the vocab projection (it then takes the max as it goes,
        without writing the logits: kernels/csrc/cpu_bf16_greedy.h); None elsewhere."""
        if self.lm_head_int8 is not None or self.lm_head_gguf is not None:
            return None
        weight = self._head_weight()
        if hidden.device.type != "cpu" or not bf16_kernel_fits(hidden, weight):
            return None
        return cpu_gemm_bf16.greedy(hidden, weight, few_tiles=layers.CPU.bf16_few_rows_tiles)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy; the embedding is the one used
            if "rotary_emb.inv_freq" in name:
                continue
            tensor = self.tp.shard(name, tensor)
            parts = name.split(".")
            packed = _PACKED.get(parts[-2]) if len(parts) >= 2 else None
            if packed is None:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                _copy(params[name], tensor, name)
                loaded.add(name)
                continue
            fused, shard = packed
            owner = ".".join(parts[:-2])
            sizes = self.get_submodule(owner).shard_sizes
            fused_name = f"{owner}.{fused}.{parts[-1]}"
            if fused == "qkv_proj" and shard < 2:
                tensor = _pair_rotary_halves(tensor, self.config.head_dim)
            _copy(params[fused_name].narrow(0, sum(sizes[:shard]), sizes[shard]), tensor, name)
            loaded.add(f"{fused_name}#{shard}")
        expected = set()
        for pname in params:
            owner, module, _ = pname.rsplit(".", 2) if pname.count(".") >= 2 else ("", "", "")
            if module in ("qkv_proj", "gate_up_proj"):
                expected |= {f"{pname}#{i}" for i in range(len(self.get_submodule(owner).shard_sizes))}
            else:
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _pair_rotary_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q_proj / k_proj rows (weight or bias) with each head's dims i and i + head_dim/2 made
    adjacent, the layout apply_rotary takes. Attention only ever uses q . k, which the same
    permutation of q and k leaves as it was (the cached keys are permuted too; only this model
    reads them)."""
    return t.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                max_positions: int, device: torch.device, dtype: torch.dtype,
                tp: TensorParallel | None = None, fused_decode: bool = False) -> LlamaForCausalLM:
    """fused_decode: dense fp32 / bf16 decode steps may run as one C call (--cpu-matmul auto:
    pagoda's kernels wanted; worker/model/fused_decode.py says where the model qualifies)."""
    # Built on "meta" so that no time goes into random initialization of weights we overwrite.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, device, tp)
    # What to_empty does, but with torch.empty: empty_like on meta tensors runs through torch's
    # Python references, which import sympy and symbolic_shapes (1.2 s of start-up).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                               device=device))
    model.load_weights(weights)
    if fused_decode:
        model.model.fused_decode = FusedDecode.build(model)
    return model.train(False).requires_grad_(False)  # inference mode, no dropout
