"""The CPU matmul kernels' paths on an emulated CPU, against float64 computed here:

    python -m tests.emulated.check_kernels --bochs PATH --kernel BZIMAGE [--model sapphire_rapids]

tests/unit/kernels/ tests every path the machine has; this runs paths it lacks (AMX,
AVX512-BF16, AVX-512F, AVX-512 VNNI) in Bochs (tests/emulated/bochs.py), for the bf16, fp32,
int8 and GGUF (Q8_0, Q4_1) projection kernels. Each call is recorded on this machine through the
kernel's own Python wrapper (its `fn` replaced by a recorder), so the guest receives exactly the
arguments a worker passes. Exit status 0 when every output agrees and the emulated CPU offered
the best path of each kernel (the `isa` functions' answers are printed)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kernels import cbuild, cpu_gemm, cpu_gemm_bf16, cpu_gemm_gguf, cpu_gemm_int8
from tests.emulated import bochs

SHAPES = [(1, 1, 1), (1, 4, 31), (2, 5, 32), (3, 8, 33), (4, 13, 64), (5, 7, 65), (8, 1536, 576),
          (1, 576, 1536), (9, 17, 100), (7, 6, 9), (64, 37, 100), (100, 3, 8),
          (5, 32, 32), (17, 70, 64), (33, 96, 96), (40, 33, 576), (64, 1536, 576), (16, 576, 1536)]
GGUF_SHAPES = [(1, 5, 32), (3, 37, 128), (4, 64, 576), (17, 70, 64), (64, 96, 576), (1, 576, 1536)]
THREADS = (1, 2, 3)


@dataclass
class Case:
    tag: str
    out_shape: tuple[int, int]
    out_dtype: torch.dtype
    judge: Callable[[torch.Tensor], float]  # worst error over the bound (<= 1 agrees)


def bf16_bound(x, w):
    """The unit test's bound: one bf16 rounding over an fp32 sum of exact products."""
    want = x.double() @ w.double().t()
    sums = x.double().abs() @ w.double().abs().t()
    tol = 2.0 ** -8 * want.abs() + 1e-6 * (x.shape[1] ** 0.5 + 1) * sums + 1e-30
    return lambda got: float(((got.double() - want).abs() / tol).max())


def sums_bound(x, w, rtol=1e-5):
    """kernels.reference.matmul_within's bound: rtol of the sum of |x||w| per entry."""
    x, w = x.double(), w.double()
    want, tol = x @ w.t(), rtol * (x.abs() @ w.abs().t()) + 1e-6
    return lambda got: float(((got.double() - want).abs() / tol).max())


def record(module, call: Callable[[], torch.Tensor], tensors: list[torch.Tensor], calls: bochs.Calls,
           buffers: dict[int, str], tag: str) -> torch.Tensor:
    """Runs `call` (a kernel wrapper) with the kernel's fn recording instead of computing, and
    adds the recorded call to `calls`: pointers to `tensors` (contiguous) or to the output
    become the guest's buffers."""
    seen = []
    real = module._kernel.fn
    module._kernel.fn = lambda *args: seen.append(args)
    try:
        out = call()
    finally:
        module._kernel.fn = real
    out_buf = calls.buffer(out.numel() * out.element_size())
    pointers = {t.data_ptr(): buffers[id(t)] for t in tensors}
    pointers[out.data_ptr()] = out_buf
    calls.call(tag, module._kernel.fn_symbol, out_buf, *[pointers.get(a, a) for a in seen[0]])
    return out


def add_inputs(calls: bochs.Calls, buffers: dict[int, str], *tensors: torch.Tensor) -> None:
    for t in tensors:
        buffers[id(t)] = calls.buffer(t.contiguous().view(torch.uint8).numpy().tobytes())


def build_cases(calls: bochs.Calls, g: torch.Generator) -> tuple[list[Case], list[torch.Tensor]]:
    cases: list[Case] = []
    buffers: dict[int, str] = {}
    keep: list[torch.Tensor] = []  # every recorded tensor alive, so that no pointer is reused

    def each(module, name, paths, inputs, wrapper, judge):
        add_inputs(calls, buffers, *inputs)
        keep.extend(inputs)
        for isa in paths:
            for threads in THREADS:
                torch.set_num_threads(threads)
                path = module.ISA_NAMES[isa].replace(' ', '_')  # the spec is split on spaces
                tag = f"{name}/{path}/{'x'.join(map(str, shape))}/t{threads}"
                out = record(module, lambda: wrapper(isa), inputs, calls, buffers, tag)
                keep.append(out)
                cases.append(Case(tag, tuple(out.shape), out.dtype, judge(isa)))

    for module in (cpu_gemm_bf16, cpu_gemm, cpu_gemm_int8, cpu_gemm_gguf):
        calls.library(cbuild.build(module.SOURCE, module.FLAGS))
        module.available()  # types fn, so that the recorder replaces a real entry point
        calls.value(f"isa:{module.__name__}", module._kernel.isa_symbol)
        paths = sorted(module.ISA_NAMES, reverse=True)
        if module is cpu_gemm_gguf:
            for kind in ("q8_0", "q4_1"):
                for shape in GGUF_SHAPES:
                    M, N, K = shape
                    x = torch.randn(M, K, generator=g)
                    blocks = module.quantize(torch.randn(N, K, generator=g), kind)
                    w = module.dequantize(blocks, kind, torch.float64)
                    each(module, kind, paths, [x, blocks], lambda isa, x=x, b=blocks, k=kind: module.xwt(x, b, k, isa),
                         lambda isa, x=x, w=w: sums_bound(module.as_seen(x, isa), w))
            continue
        for shape in SHAPES:
            M, N, K = shape
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            if module is cpu_gemm_bf16:
                x, w = x.bfloat16(), w.bfloat16()
                each(module, "bf16", paths, [x, w], lambda isa, x=x, w=w: module.xwt(x, w, isa),
                     lambda isa, x=x, w=w: bf16_bound(x, w))
            elif module is cpu_gemm:
                each(module, "fp32", paths, [x, w], lambda isa, x=x, w=w: module.xwt(x, w, isa),
                     lambda isa, x=x, w=w: sums_bound(x, w))
            else:
                w8, scale = module.quantize(w)
                each(module, "int8", paths, [x, w8, scale],
                     lambda isa, x=x, w8=w8, s=scale: module.xwt(x, w8, s, isa),
                     lambda isa, x=x, w8=w8, s=scale: sums_bound(x, w8.double() * s.double()[:, None]))
    return cases, keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bochs", type=Path, required=True)
    parser.add_argument("--kernel", type=Path, required=True, help="a Linux bzImage (5.16 or later, for AMX)")
    parser.add_argument("--model", default="sapphire_rapids", help="Bochs' CPU model")
    parser.add_argument("--keep", type=Path, help="keep the guest's files under this folder")
    args = parser.parse_args()

    calls = bochs.Calls()
    cases, _kept = build_cases(calls, torch.Generator().manual_seed(0))
    result = bochs.run(calls, args.bochs, args.kernel, args.model, keep=args.keep)
    print(f"{args.model}: guest ran {result.seconds:.0f} s")
    failures = 0
    for module in (cpu_gemm_bf16, cpu_gemm, cpu_gemm_int8, cpu_gemm_gguf):
        best = result.values.get(f"isa:{module.__name__}", 0)
        top = max(module.ISA_NAMES)
        print(f"{module.__name__}: best path {module.ISA_NAMES.get(best, 'none')}")
        if best != top:
            print(f"FAIL: not its best path, {module.ISA_NAMES[top]}")
            failures += 1
    for case in cases:
        raw = result.outputs.get(case.tag)
        if raw is None:
            print(f"FAIL {case.tag}: no output")
            failures += 1
            continue
        got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(case.out_dtype).view(case.out_shape)
        worst = case.judge(got)
        failures += not worst <= 1
        print(f"{'ok  ' if worst <= 1 else 'FAIL'} {case.tag}: worst error {worst:.3f} of the bound")
    print(f"{len(cases) + 4 - failures}/{len(cases) + 4} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
