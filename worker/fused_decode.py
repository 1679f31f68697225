"""A GGUF-quantized Llama model's decode steps in one C call (kernels/cpu_decode_layer.c) instead
of layer by layer in torch.

A single stream's Q4_1 step reads about 10 ms of weights; layer by layer it took 19-25 ms, the
rest being torch's dispatch of some 25 small ops a layer and as many parallel regions
(docs/benchmarks.md). The C step runs the same layers with the same kernels (the GGUF dot
products, the paged decode attention) in one parallel region.

It takes a step when every token in it is a decode row of the attention plan (one new token of
a sequence, or a verification's few: kernels/cpu_attention.py MAX_KERNEL_DECODE_ROWS) and there
are at most MAX_TOKENS of them; any other step (a prefill chunk, a wide batch, a cache the C
attention does not serve) runs layer by layer. The model qualifies when it runs on the CPU in
fp32 with GGUF weights (--quantization q8_0 / q4_1) and exact activations, without biases,
tensor parallelism or another attention backend, and the kernel agrees with its float64
reference here (checked once; it is turned off, with a log line, if not).
"""
from __future__ import annotations

import logging

import torch

from kernels import cpu_decode_attention, cpu_decode_layer, cpu_gemm_gguf
from kernels.cpu_decode_layer import LayerWeights, Shape
from worker.layers import GGUF_KERNEL_MAX_ROWS, Linear

# Tokens up to which a step goes through the C step: the GGUF kernel's own bound, above which a
# projection is faster dequantized into torch's GEMM.
MAX_TOKENS = GGUF_KERNEL_MAX_ROWS
enabled = True  # bench/profile_cpu.py --fused-ab turns it off to time the torch layers

log = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, model, kind: str) -> None:
        config = model.config
        inner = model.model
        self.shape = Shape(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                           config.intermediate_size, config.rms_norm_eps, kind)
        self.weights = [LayerWeights(layer.self_attn.qkv_proj.blocks, layer.self_attn.o_proj.blocks,
                                     layer.mlp.gate_up_proj.blocks, layer.mlp.down_proj.blocks,
                                     layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
                        for layer in inner.layers]
        self.final_norm = inner.norm.weight
        self.cis = inner.rotary.cis
        self.backend = inner.layers[0].self_attn.attn.backend
        self._layers, self._caches = None, None

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused step for this model, or None where it does not qualify (module docstring)."""
        linears = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
        kinds = {m.kind for m in linears}
        if (len(kinds) != 1 or None in kinds or any(m.bias is not None for m in linears)
                or model.tp.size != 1 or getattr(model.model.layers[0].self_attn.attn.backend, "name", "") != "torch"
                or model.model.norm.weight.dtype != torch.float32 or model.model.norm.weight.device.type != "cpu"
                or cpu_gemm_gguf.int8_activations or not cpu_decode_layer.available()
                or not cpu_decode_layer.agrees_with_reference()):
            return None
        return cls(model, kinds.pop())

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor | None:
        """The final-normed hidden states of the step, or None: run it layer by layer. x: the
        embeddings, which become the residual stream (summed in place)."""
        T = x.shape[0]
        k_cache = kv_caches[0][0]
        if not enabled or T > MAX_TOKENS or x.dtype != torch.float32 or not cpu_decode_attention.runs_on(k_cache):
            return None
        plan = self.backend.plan(meta, k_cache, self.shape.num_heads)
        decode = plan.decode
        if not plan.kernel or plan.prefills or plan.shorts or decode is None or decode.rows.numel() != T:
            return None
        return cpu_decode_layer.decode_step(
            self._layers_for(kv_caches), self.shape, self.final_norm, x.contiguous(), self.cis,
            positions.to(torch.int64).contiguous(), meta.slot_mapping.to(torch.int64).contiguous(),
            decode.rows.to(torch.int32), decode.lens.to(torch.int32).contiguous(), decode.tables, k_cache)

    def _layers_for(self, kv_caches):
        """The kernel's layer array, rebuilt only when the caches are other tensors."""
        caches = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        if caches != self._caches:
            self._layers, self._caches = cpu_decode_layer.layers_array(self.weights, kv_caches), caches
        return self._layers
