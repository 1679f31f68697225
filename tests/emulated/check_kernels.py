"""The bf16 projection kernel's paths on an emulated CPU, against float64 computed here:

    python -m tests.emulated.check_kernels --bochs PATH --kernel VMLINUZ [--model sapphire_rapids]

tests/unit/kernels/test_kernels_cpu_gemm_bf16.py tests every path the machine has; this runs the
same shapes and tolerance on paths it lacks (AMX on Sapphire Rapids, AVX512-BF16), in Bochs
(tests/emulated/bochs.py). Exit status 0 when every output agrees and the CPU offered the paths
asked for (--want)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kernels import cbuild, cpu_gemm_bf16
from tests.emulated import bochs

SHAPES = [(1, 1, 1), (1, 4, 31), (2, 5, 32), (3, 8, 33), (4, 13, 64), (5, 7, 65), (8, 1536, 576),
          (1, 576, 1536), (9, 17, 100), (7, 6, 9), (64, 37, 100), (100, 3, 8),
          (5, 32, 32), (17, 70, 64), (33, 96, 96), (40, 33, 576), (64, 1536, 576), (16, 576, 1536)]
THREADS = (1, 2, 3)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


def within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[bool, float]:
    """The unit test's bound: one bf16 rounding over an fp32 sum of exact products."""
    want = x.double() @ w.double().t()
    sums = x.double().abs() @ w.double().abs().t()
    tol = 2.0 ** -8 * want.abs() + 1e-6 * (x.shape[1] ** 0.5 + 1) * sums + 1e-30
    err = (got.double() - want).abs()
    return bool((err <= tol).all()), float((err / tol.clamp_min(1e-30)).max()) if err.numel() else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bochs", type=Path, required=True)
    parser.add_argument("--kernel", type=Path, required=True, help="a Linux bzImage (5.16 or later, for AMX)")
    parser.add_argument("--model", default="sapphire_rapids", help="Bochs' CPU model")
    parser.add_argument("--want", type=int, nargs="*", default=[3, 2, 1],
                        help="paths that must run (3 AMX, 2 AVX512-BF16, 1 AVX2)")
    parser.add_argument("--keep", type=Path, help="keep the guest's files under this folder")
    args = parser.parse_args()

    lib = cbuild.build(cpu_gemm_bf16.SOURCE, cpu_gemm_bf16.FLAGS)
    calls = bochs.Calls()
    calls.library(lib)
    calls.value("isa", "pagoda_bf16_isa")
    g = torch.Generator().manual_seed(0)
    cases = {}
    for i, (M, N, K) in enumerate(SHAPES):
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        xb, wb = calls.buffer(bits(x)), calls.buffer(bits(w))
        for isa in args.want:
            for threads in THREADS:
                tag = f"{isa}:{M}x{N}x{K}:t{threads}"
                out = calls.buffer(M * N * 2)
                calls.call(tag, "pagoda_bf16_xwt", out, xb, K, wb, K, out, N, M, N, K, threads, isa)
                cases[tag] = (x, w)
    result = bochs.run(calls, args.bochs, args.kernel, args.model, keep=args.keep)
    best = result.values.get("isa", 0)
    print(f"{args.model}: pagoda_bf16_isa() = {best} ({cpu_gemm_bf16.ISA_NAMES.get(best, 'none')}); "
          f"guest ran {result.seconds:.0f} s")
    failures = 0
    if best < max(args.want):
        print(f"FAIL: the emulated CPU's best path is {best}, below the {max(args.want)} asked for")
        failures += 1
    for tag, (x, w) in cases.items():
        raw = result.outputs.get(tag)
        if raw is None:
            print(f"FAIL {tag}: no output")
            failures += 1
            continue
        got = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).view(x.shape[0], w.shape[0])
        ok, worst = within(got, x, w)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {tag}: worst error {worst:.3f} of the bound")
    print(f"{len(cases) - failures if failures <= len(cases) else 0}/{len(cases)} agree with float64")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
