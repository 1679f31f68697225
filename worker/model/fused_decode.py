"""A Llama model's decode steps in one C call (kernels/csrc/cpu_decode_layer.c) instead of layer by
layer in torch, for GGUF-quantized and int8 weights and for dense fp32 and bf16 ones.

A single stream's Q4_1 step reads about 10 ms of weights; layer by layer it took 19-25 ms, the
rest being torch's dispatch of some 25 small ops a layer and as many parallel regions
(docs/benchmarks.md). An fp32 or bf16 step pays the same overhead over larger reads. The C step
runs the same layers with the same kernels (the dot products, the paged decode attention) in one
parallel region; a bf16 model's activations are fp32 inside it (its weights are widened
exactly), and the step's output is rounded to bf16 for the vocabulary projection.

It takes a step when every token in it is a decode row of the attention plan (one new token of
a sequence, or a verification's few: kernels/cpu_attention.py MAX_KERNEL_DECODE_ROWS) and there
are at most max_tokens of them; any other step (a prefill chunk, a wide batch, a cache the C
attention does not serve) runs layer by layer. The model qualifies when it runs on the CPU with
GGUF or int8 weights (--quantization q8_0 / q4_1 / int8, fp32, exact activations) or with dense fp32 / bf16
weights where pagoda's kernels are wanted (--cpu-matmul auto: worker/model/llama.py build_model),
without biases, tensor parallelism or another attention backend, and the kernel agrees with its
float64 reference here for that format (checked once; it is turned off, with a log line, if
not).
"""
from __future__ import annotations

import logging

import torch

from pagoda.kernels import cpu_decode_attention, cpu_decode_layer, cpu_gemm_gguf
from pagoda.kernels.cpu_decode_layer import LayerWeights, Shape
from worker.model.layers import Linear

# Tokens up to which a step goes through the C step. GGUF: MAX_TOKENS, whatever the GGUF
# kernel's bound for a projection alone (worker/model/layers.py QUANTIZED_KERNEL_ROWS): on a Zen 5 EPYC the
# C step beat the layers at 8, 32 and 64 decodes of Q4_1 (64: 206 against 209 ms). Dense: the machine's, measured at
# start-up (worker/startup/measurements.py measure_decode_step_bound); MAX_DENSE_TOKENS until
# then, or where the pool is too small to time in. On an AVX2 EPYC the C step won at 8 decodes
# (fp32 58 against 60 ms, bf16 53 against 65) and lost at 32 in fp32 (174 against 143); on a
# Zen 5 it lost from 4 in fp32 and 6 in bf16 (bench/profile_cpu.py --fused-ab, docs/benchmarks.md)
# until bf16 steps of 5 or more tokens took AVX512-BF16 dot products (kernels/cpu_decode_layer.py
# BF16_DOT_MIN_TOKENS): 8 decodes 13 against 15 ms, 12 15 against 17, 16 even; measured 16.
# Since the weight panels (kernels/csrc/cpu_weight_panel.h) take steps of 12 or more tokens on
# AVX2, the C step also wins at 32 and 64 fp32 decodes on a Zen 2 EPYC (143 against 154 ms, 272
# against 284), so the measurement times those counts too (worker_flags.py DECODE_STEP_TOKENS).
MAX_TOKENS = 64  # the C step's most for GGUF weights (worker_flags.py MAX_DECODE_STEP_TOKENS)
MAX_DENSE_TOKENS = 8
enabled = True  # bench/profile_cpu.py --fused-ab turns it off to time the torch layers

log = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, model, kind: str) -> None:
        config = model.config
        inner = model.model
        self.shape = Shape(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                           config.intermediate_size, config.rms_norm_eps, kind)
        dense = kind in cpu_decode_layer.DENSE

        def rows(linear: Linear) -> torch.Tensor:
            if kind == cpu_decode_layer.INT8:
                return linear.w8
            return linear.weight.contiguous() if dense else linear.blocks

        def norm(weight: torch.Tensor) -> torch.Tensor:  # the kernel's norms are fp32 (a bf16 model's: a copy)
            return weight.float().contiguous()

        def layer_weights(layer) -> LayerWeights:
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            scales = tuple(m.scale for m in projections) if kind == cpu_decode_layer.INT8 else None
            return LayerWeights(*(rows(m) for m in projections), norm(layer.input_layernorm.weight),
                                norm(layer.post_attention_layernorm.weight), scales=scales)
        self.weights = [layer_weights(layer) for layer in inner.layers]
        self.final_norm = norm(inner.norm.weight)
        self.cis = inner.rotary.cis
        self.backend = inner.layers[0].self_attn.attn.backend
        self.dtype = inner.norm.weight.dtype  # the model's activations, which the step takes and gives
        self.dense = dense
        # A dense model's bound is set again at start-up (worker/startup/measurements.py).
        self.max_tokens = MAX_DENSE_TOKENS if dense else MAX_TOKENS
        self._layers, self._caches = None, None

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused step for this model, or None where it does not qualify (module docstring)."""
        linears = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
        kind = _kind(linears, model.config)
        if (kind is None or any(m.bias is not None for m in linears)
                or model.tp.size != 1 or getattr(model.model.layers[0].self_attn.attn.backend, "name", "") != "torch"
                or model.model.norm.weight.device.type != "cpu"
                or (kind not in cpu_decode_layer.DENSE and cpu_gemm_gguf.int8_activations)
                or not cpu_decode_layer.available() or not cpu_decode_layer.agrees_with_reference(kind)):
            return None
        fused = cls(model, kind)
        log.info("decode steps of up to %d tokens run as one C call (kernels/cpu_decode_layer.c, %s "
                 "weights, %s)%s", fused.max_tokens, kind, cpu_decode_layer.isa(),
                 ", until start-up sets this machine's bound" if fused.dense else "")
        return fused

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor | None:
        """The final-normed hidden states of the step, or None: run it layer by layer. x: the
        embeddings, which become the residual stream (summed in place)."""
        T = x.shape[0]
        k_cache = kv_caches[0][0]
        if not enabled or T > self.max_tokens or x.dtype != self.dtype or not cpu_decode_attention.runs_on(k_cache):
            return None
        plan = self.backend.plan(meta, k_cache, self.shape.num_heads)
        decode = plan.decode
        if (not plan.kernel or plan.prefills or plan.shorts or plan.kernel_prefill is not None or decode is None
                or decode.rows.numel() != T):
            return None
        out = cpu_decode_layer.decode_step(
            self._layers_for(kv_caches), self.shape, self.final_norm, x.float().contiguous(), self.cis,
            positions.to(torch.int64).contiguous(), meta.slot_mapping.to(torch.int64).contiguous(),
            decode.rows.to(torch.int32), decode.lens.to(torch.int32).contiguous(), decode.tables, k_cache)
        return out.to(self.dtype)

    def _layers_for(self, kv_caches):
        """The kernel's layer array, rebuilt only when the caches are other tensors."""
        caches = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        if caches != self._caches:
            self._layers, self._caches = cpu_decode_layer.layers_array(self.weights, kv_caches), caches
        return self._layers


def _kind(linears: list[Linear], config) -> str | None:
    """The one weight format every projection has, if the C step takes it: a GGUF kind, "int8",
    or "f32" / "bf16" for dense weights; int8 and dense ones of widths the dense dot products take
    (multiples of 32)."""
    widths = (config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)
    int8 = {m.w8 is not None for m in linears}
    if int8 == {True}:
        return None if any(w % 32 for w in widths) else cpu_decode_layer.INT8
    if True in int8:
        return None
    kinds = {m.kind for m in linears}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is not None:
        return kind
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) != 1 or any(w % 32 for w in widths):
        return None
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtypes.pop())
