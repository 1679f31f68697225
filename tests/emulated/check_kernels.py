"""The CPU kernels' paths on an emulated CPU, against float64 computed here:

    python -m tests.emulated.check_kernels --bochs PATH --kernel BZIMAGE [--model sapphire_rapids]
    python -m tests.emulated.check_kernels --here      (this machine's paths: the harness's check)

tests/unit/kernels/ tests every path the machine has; this runs paths it lacks (AMX,
AVX512-BF16, AVX-512F, AVX-512 VNNI) in Bochs (tests/emulated/bochs.py), for the bf16, fp32,
int8 and GGUF (Q8_0, Q4_1) projection kernels, the decode and prefill attention kernels and the
one-call decode step (tests/emulated/step_cases.py), on their unit tests' shapes and bounds. Each call is recorded on this machine through the kernel's
own Python wrapper (its `fn` replaced by a recorder), so the guest receives exactly the
arguments a worker passes. Exit status 0 when every output agrees and the emulated CPU offered
the best path of each kernel (the `isa` functions' answers are printed)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pagoda.kernels import cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8
from pagoda.kernels.reference import bf16_matmul_error, matmul_error
from tests.emulated import bochs
from tests.emulated.recording import THREADS, Case, add_inputs, into_nan, path_name, paths, record, use_library, within
from tests.emulated.step_cases import BF16_DOT_VALUE, decode_step_cases

SHAPES = [(1, 1, 1), (1, 4, 31), (2, 5, 32), (3, 8, 33), (4, 13, 64), (5, 7, 65), (8, 1536, 576),
          (1, 576, 1536), (9, 17, 100), (7, 6, 9), (64, 37, 100), (100, 3, 8),
          (5, 32, 32), (17, 70, 64), (33, 96, 96), (40, 33, 576), (64, 1536, 576), (16, 576, 1536)]
GGUF_SHAPES = [(1, 5, 32), (3, 37, 128), (4, 64, 576), (17, 70, 64), (64, 96, 576), (1, 576, 1536)]


def bf16_bound(x, w):
    return lambda got: bf16_matmul_error(got, x, w)


def sums_bound(x, w, rtol=1e-5):
    return lambda got: matmul_error(got, x, w, rtol)


def build_cases(calls: bochs.Calls, g: torch.Generator, here: bool = False) -> tuple[list[Case], list[torch.Tensor]]:
    """here: only the paths this CPU has (a run on this machine)."""
    cases: list[Case] = []
    buffers: dict[int, str] = {}
    keep: list[torch.Tensor] = []  # every recorded tensor alive, so that no pointer is reused

    def each(module, name, shape, isas, inputs, wrapper, judge):
        add_inputs(calls, buffers, *inputs)
        keep.extend(inputs)
        for isa in isas:
            for threads in THREADS:
                torch.set_num_threads(threads)
                tag = f"{name}/{path_name(module, isa)}/{'x'.join(map(str, shape))}/t{threads}"
                out = record(module, lambda: wrapper(isa), inputs, calls, buffers, tag)
                keep.append(out)
                cases.append(Case(tag, tuple(out.shape), out.dtype, judge(isa)))

    for module in (cpu_gemm_bf16, cpu_gemm, cpu_gemm_int8, cpu_gemm_gguf):
        use_library(calls, module)
        isas = paths(module, here)
        if module is cpu_gemm_gguf:
            for kind in ("q8_0", "q4_1"):
                for shape in GGUF_SHAPES:
                    M, N, K = shape
                    x = torch.randn(M, K, generator=g)
                    blocks = module.quantize(torch.randn(N, K, generator=g), kind)
                    w = module.dequantize(blocks, kind, torch.float64)
                    each(module, kind, shape, isas, [x, blocks], lambda isa, x=x, b=blocks, k=kind: module.xwt(x, b, k, isa),
                         lambda isa, x=x, w=w: sums_bound(module.as_seen(x, isa), w))
            continue
        for shape in SHAPES:
            M, N, K = shape
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            if module is cpu_gemm_bf16:
                x, w = x.bfloat16(), w.bfloat16()
                each(module, "bf16", shape, isas, [x, w], lambda isa, x=x, w=w: module.xwt(x, w, isa),
                     lambda isa, x=x, w=w: bf16_bound(x, w))
            elif module is cpu_gemm:
                each(module, "fp32", shape, isas, [x, w], lambda isa, x=x, w=w: module.xwt(x, w, isa),
                     lambda isa, x=x, w=w: sums_bound(x, w))
            else:
                w8, scale = module.quantize(w)
                each(module, "int8", shape, isas, [x, w8, scale],
                     lambda isa, x=x, w8=w8, s=scale: module.xwt(x, w8, s, isa),
                     lambda isa, x=x, w8=w8, s=scale: sums_bound(x, w8.double() * s.double()[:, None]))
    cases += attention_cases(calls, buffers, keep, here)
    cases += prefill_cases(calls, buffers, keep, here)
    cases += decode_step_cases(calls, buffers, keep, here)
    return cases, keep


def attention_cases(calls: bochs.Calls, buffers: dict[int, str], keep: list[torch.Tensor],
                    here: bool = False) -> list[Case]:
    """The decode attention kernel on the unit test's cases (a poisoned cache: NaN wherever no
    sequence reads), fp32 and bf16 caches, heads one by one and by kv head, within its TOL."""
    from pagoda.kernels import cpu_decode_attention as attention
    from tests.unit.kernels.test_kernels import Batch
    from tests.unit.kernels.test_kernels_cpu_decode_attention import CASES, TOL, _key_layout

    use_library(calls, attention)
    cases = []
    for n, (name, (ctx_lens, hq, hkv, d, bs)) in enumerate(CASES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            batch = Batch(ctx_lens, [1] * len(ctx_lens), hq, hkv, d, bs, dtype, seed=n)
            k_cache = _key_layout(batch)
            rows = torch.arange(len(ctx_lens), dtype=torch.int32)
            tables = batch.block_tables.to(torch.int32).contiguous()
            shared = [batch.q, k_cache, batch.v_cache, rows, batch.seq_lens, tables]
            add_inputs(calls, buffers, *shared)
            keep.extend(shared)
            judge = within(batch.expected()[1], TOL[dtype])
            for isa in paths(attention, here):
                for grouping in (0, 1):
                    for threads in THREADS:
                        torch.set_num_threads(threads)
                        tag = f"attention/{path_name(attention, isa)}/{name}/{str(dtype)[6:]}/g{grouping}/t{threads}"
                        cases.append(into_nan(calls, buffers, keep, attention, tag, shared, batch.q, judge,
                                              lambda out: attention.decode(
                                                  batch.q, k_cache, batch.v_cache, rows, batch.seq_lens, tables,
                                                  batch.scale, out, isa=isa, grouping=grouping, ahead=True)))
    return cases


def judged(case: Case, result: bochs.Result) -> float:
    """The case's worst error over its bound (inf where the runner printed no output)."""
    raw = result.outputs.get(case.tag)
    if raw is None:
        return float("inf")
    got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(case.out_dtype).view(case.out_shape)
    return case.judge(got)


def prefill_cases(calls: bochs.Calls, buffers: dict[int, str], keep: list[torch.Tensor],
                  here: bool = False) -> list[Case]:
    """The prefill attention kernel on its unit test's cases (fresh and cached prompts, causal),
    fp32 and bf16, within its TOL."""
    from pagoda.kernels import cpu_prefill_attention as prefill
    from tests.unit.kernels.test_kernels import Batch
    from tests.unit.kernels.test_kernels_cpu_decode_attention import _key_layout
    from tests.unit.kernels.test_kernels_cpu_prefill_attention import CASES, TOL

    use_library(calls, prefill)
    cases = []
    for n, (name, (ctx, new, hq, hkv, d, bs)) in enumerate(CASES.items()):
        for dtype in (torch.float32, torch.bfloat16):
            batch = Batch(ctx, new, hq, hkv, d, bs, dtype, seed=n)
            k_cache = _key_layout(batch)
            qsl = batch.query_start_loc.to(torch.int32)
            starts, counts = qsl[:-1].contiguous(), (qsl[1:] - qsl[:-1]).contiguous()
            lens, tables = batch.seq_lens.to(torch.int32).contiguous(), batch.block_tables.to(torch.int32).contiguous()
            shared = [batch.q, k_cache, batch.v_cache, starts, counts, lens, tables]
            add_inputs(calls, buffers, *shared)
            keep.extend(shared)
            judge = within(batch.expected()[1], TOL[dtype])
            for isa in paths(prefill, here):
                for threads in THREADS:
                    torch.set_num_threads(threads)
                    tag = f"prefill/{path_name(prefill, isa)}/{name}/{str(dtype)[6:]}/t{threads}"
                    cases.append(into_nan(calls, buffers, keep, prefill, tag, shared, batch.q, judge,
                                          lambda out: prefill.prefill(batch.q, k_cache, batch.v_cache, starts,
                                                                      counts, lens, tables, batch.scale, out,
                                                                      isa=isa)))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bochs", type=Path)
    parser.add_argument("--kernel", type=Path, help="a Linux bzImage (5.16 or later, for AMX)")
    parser.add_argument("--model", default="sapphire_rapids", help="Bochs' CPU model")
    parser.add_argument("--keep", type=Path, help="keep the guest's files under this folder")
    parser.add_argument("--here", action="store_true",
                        help="run the calls on this machine instead, the paths it has (checks the harness)")
    args = parser.parse_args()
    if not args.here and not (args.bochs and args.kernel):
        parser.error("--bochs and --kernel, or --here")

    calls = bochs.Calls()
    cases, _kept = build_cases(calls, torch.Generator().manual_seed(0), args.here)
    if args.here:
        result = bochs.run_here(calls)
        print(f"this machine: the runner ran {result.seconds:.0f} s")
    else:
        result = bochs.run(calls, args.bochs, args.kernel, args.model, keep=args.keep)
        print(f"{args.model}: guest ran {result.seconds:.0f} s")
    failures = 0
    from pagoda.kernels import cpu_decode_attention, cpu_decode_layer, cpu_prefill_attention
    modules = (cpu_gemm_bf16, cpu_gemm, cpu_gemm_int8, cpu_gemm_gguf, cpu_decode_attention, cpu_prefill_attention,
               cpu_decode_layer)
    dots = result.values.get(BF16_DOT_VALUE, 0)
    print(f"{cpu_decode_layer.__name__}: bf16 products {('widened', 'dot products', 'AMX tiles')[dots]}")
    if dots != (cpu_decode_layer.bf16_dot_here() if args.here else 2):
        print("FAIL: the decode step's bf16 dot products are not what the CPU offers")
        failures += 1
    for module in modules:
        best = result.values.get(f"isa:{module.__name__}", 0)
        top = module._kernel.best if args.here else max(module.ISA_NAMES)
        print(f"{module.__name__}: best path {module.ISA_NAMES.get(best, 'none')}")
        if best != top:
            print(f"FAIL: not its best path, {module.ISA_NAMES[top]}")
            failures += 1
    for case in cases:
        worst = judged(case, result)
        failures += not worst <= 1
        print(f"{'ok  ' if worst <= 1 else 'FAIL'} {case.tag}: worst error {worst:.3f} of the bound")
    checks = len(cases) + len(modules) + 1
    print(f"{checks - failures}/{checks} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
