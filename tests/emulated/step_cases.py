"""The one-call decode step (kernels/csrc/cpu_decode_layer.c) for tests/emulated: its unit test's
steps (several sequences, a verification's tokens, block size 5, 17 rows), every weight format
and cache dtype, each path, and on AVX-512 the bf16 dot products, against its float64 reference
within the unit test's tolerances. The step takes its layers and its parameters as structures
of pointers (recorded with their pointer fields relocated), and sums into its residual stream
and writes its caches in place, so each call gets its own copies of those."""
from __future__ import annotations

import torch

from pagoda.kernels import cpu_decode_layer
from pagoda.kernels.cpu_decode_layer import Shape
from tests.emulated import bochs
from tests.emulated.recording import THREADS, Case, add_inputs, path_name, paths, record, use_library
from tests.unit.kernels.test_kernels_cpu_decode_layer import SHAPE, STEPS, TOL, _model, _step
from worker.model.layers import RotaryEmbedding

BF16_DOT_VALUE = "bf16_dot:pagoda.kernels.cpu_decode_layer"


def relative(want: torch.Tensor, tol: float):
    """The unit test's measure: error over max(|want|, 1), as a share of tol; inf for a NaN."""
    return lambda got: (float("inf") if got.isnan().any()
                        else float(((got.double() - want).abs() / want.abs().clamp(min=1)).max()) / tol)


def decode_step_cases(calls: bochs.Calls, buffers: dict[int, str], keep: list, here: bool = False) -> list[Case]:
    use_library(calls, cpu_decode_layer)
    calls.value(BF16_DOT_VALUE, "pagoda_decode_layer_bf16_dot")
    products = 2 if not here else cpu_decode_layer.bf16_dot_here()  # the emulated Sapphire Rapids: AMX
    cis = RotaryEmbedding(SHAPE["head_dim"], 128, 10000.0).cis
    add_inputs(calls, buffers, cis)
    keep.append(cis)
    cases = []
    for n, (name, (seqs, bs)) in enumerate(STEPS.items()):
        for kind in ("q4_1", "q8_0", "int8", "f32", "bf16"):
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(n)
                weights, final_norm = _model(kind, g)
                caches, positions, slots, lens, tables = _step(seqs, bs, dtype, g)
                T = positions.numel()
                h, rows = torch.randn(T, SHAPE["hidden"], generator=g), torch.arange(T, dtype=torch.int32)
                shape = Shape(**SHAPE, kind=kind)
                inputs = [final_norm, h, positions, slots, rows, lens, tables, *_tensors(caches), *_tensors(weights)]
                add_inputs(calls, buffers, *inputs)
                keep.extend(inputs)
                dots = list(range(products + 1)) if kind == "bf16" else [0]  # widened, dot products, AMX
                for dot in dots:
                    want = cpu_decode_layer.reference(weights, shape, final_norm, h, cis, positions, slots,
                                                      [(k.clone(), v.clone()) for k, v in caches], lens, tables, dot)
                    tol = max(TOL[dtype], cpu_decode_layer.BF16_DOT_TOL) if dot else TOL[dtype]
                    for isa in paths(cpu_decode_layer, here):
                        if dot and isa != 2:  # the dot products are the AVX-512 step's
                            continue
                        for threads in THREADS:
                            torch.set_num_threads(threads)
                            tag = (f"step/{path_name(cpu_decode_layer, isa)}/{name}/{kind}/{str(dtype)[6:]}"
                                   f"/dot{int(dot)}/t{threads}")
                            cases.append(_recorded(calls, buffers, keep, tag, weights, shape, final_norm, h, caches,
                                                   (cis, positions, slots, rows, lens, tables), isa, dot,
                                                   relative(want, tol)))
    return cases


def _recorded(calls, buffers, keep, tag, weights, shape, final_norm, h, caches, plan, isa, dot, judge) -> Case:
    """One step recorded on fresh copies of the stream and the caches (copied in the guest too,
    from the originals' buffers, just before the call)."""
    stream = h.clone()
    run_caches = [(k.clone(), v.clone()) for k, v in caches]
    for copy, original in zip([stream, *_tensors(run_caches)], [h, *_tensors(caches)]):
        buffers[id(copy)] = calls.copy(buffers[id(original)])
        keep.append(copy)
    layers = cpu_decode_layer.layers_array(weights, run_caches)
    keep.append(layers)
    cis, positions, slots, rows, lens, tables = plan
    tensors = [final_norm, stream, *plan, *_tensors(run_caches), *_tensors(weights)]
    out = record(cpu_decode_layer,
                 lambda: cpu_decode_layer.decode_step(layers, shape, final_norm, stream, cis, positions, slots, rows,
                                                      lens, tables, run_caches[0][0], isa=isa, bf16_dot=dot),
                 tensors, calls, buffers, tag, structs=(layers,))
    keep.append(out)
    return Case(tag, tuple(out.shape), out.dtype, judge)


def _tensors(items) -> list[torch.Tensor]:
    """Every tensor of a list of (K, V) caches, or of LayerWeights."""
    if isinstance(items[0], tuple):
        return [c for pair in items for c in pair]
    return [t for w in items for t in (w.qkv, w.o, w.gate_up, w.down, w.norm1, w.norm2, *(w.scales or ()))]
