#!/usr/bin/env python3
"""Benchmarks of the Triton attention kernels on one GPU, and a compile check that needs none.

    python3 -m bench.bench_attention [--out DIR] [--budget SECONDS]
        On CUDA: a bf16 correctness check, decode bandwidth against a device-to-device copy,
        prefill against torch SDPA (causal), and small tile-config sweeps for tuning. Prints
        markdown tables and writes them to DIR/bench_attention.md (DIR defaults to $OUT).
    python3 -m bench.bench_attention --compile-check [quick]
        No GPU needed: cross-compiles the kernel variants the engine uses for sm_90 with the
        Triton JIT's own argument specialisation, and reports registers, spills and shared
        memory. Exit 0: all fine; 1: a 16-bit variant spills or fails to compile; 3: cannot check
        here (no ptxas, or a Triton whose private compile API differs).

The CPU backend's benchmarks are bench/bench_cpu_attention.py's.

Run from anywhere; the repository root is put on sys.path. Needs only torch and triton.
PAGODA_BENCH_DRY=1 runs every GPU section on the CPU under the Triton interpreter at toy sizes
(float16), to check the script itself without a GPU; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRY = os.environ.get("PAGODA_BENCH_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
if DRY:
    torch.set_num_threads(1)
DTYPE = torch.float16 if DRY else torch.bfloat16
# Decode goal: >= 80% of copy bandwidth for B >= 32 and context >= 4096. Prefill: >= 0.8x SDPA.
DECODE_GOAL, PREFILL_GOAL = 0.8, 0.8
HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
BATCHES, CONTEXTS = (1, 8, 32, 128), (512, 4096, 16384)
PREFILL_MAX_TOKENS = 131072        # B * context cap for the prefill table (time and memory)
if DRY:
    HQ, HKV, D, BATCHES, CONTEXTS, PREFILL_MAX_TOKENS = 4, 2, 32, (1, 2), (20, 70), 100


# ---------------------------------------------------------------------------------------------
# Compile check (no GPU)


def _compile(kernel, args, constexprs, options, target):
    """Compiles one launch the way JITFunction.run would on a GPU of `target`."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(constexprs, **options)
    bound_args, specialization, opts = binder(*args, **kwargs)
    opts, signature, consts, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                       opts)
    return triton.compile(ASTSource(kernel, signature, consts, attrs), target=target,
                          options=opts.__dict__)


def _resources(compiled) -> dict:
    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", text)
    return {"regs": int(found[1]), "stack": int(found[2]) if found else -1,
            "smem": compiled.metadata.shared}


def compile_check(quick: bool = False) -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import TritonError
        from pagoda.kernels import triton_attention as ta
    except Exception as exc:
        print(f"cannot check: {exc}")
        return 3
    target = GPUTarget("cuda", 90, 32)
    meta = lambda *shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731

    def attention(dtype, hq, hkv, d, bs, num_seqs, max_seq, max_q):
        cfg = ta.choose_config(hq, hkv, d, dtype, num_seqs, max_seq, max_q, 132)
        q = meta(num_seqs * max_q, hq, d, dtype=dtype)
        cache = meta(1024, bs, hkv, d, dtype=dtype)
        tables = meta(num_seqs, 256, dtype=torch.int32)
        lens = meta(num_seqs, dtype=torch.int32)
        qsl = meta(num_seqs + 1, dtype=torch.int32)
        return cfg, ta.paged_attention_launches(q, cache, cache, tables, lens, qsl, 0.1, q, cfg)

    def write(dtype, hkv, d, bs):
        kv = meta(64, hkv, d, dtype=dtype)
        cache = meta(1024, bs, hkv, d, dtype=dtype)
        return "-", ta.write_kv_launches(kv, kv, cache, cache, meta(64, dtype=torch.int64))

    # (name, (config, launches), spills allowed): the shapes of the benchmark and of SmolLM2.
    variants = [
        ("decode bf16 32x8 D128 (split)", attention(torch.bfloat16, 32, 8, 128, 16, 32, 4096, 1), False),
        ("prefill bf16 32x8 D128", attention(torch.bfloat16, 32, 8, 128, 16, 8, 4096, 512), False),
        ("decode bf16 9x3 D64 (SmolLM2)", attention(torch.bfloat16, 9, 3, 64, 16, 64, 2048, 1), False),
        ("prefill fp16 9x3 D64 bs32 (SmolLM2)", attention(torch.float16, 9, 3, 64, 32, 4, 512, 300), False),
        ("decode fp16 4x2 D80 bs8 (padded head dim)", attention(torch.float16, 4, 2, 80, 8, 2, 900, 1), False),
        ("decode fp32 32x8 D128", attention(torch.float32, 32, 8, 128, 16, 256, 4096, 1), True),
        ("write_kv bf16 8x128", write(torch.bfloat16, 8, 128, 16), False),
    ]
    if quick:                         # the tests: one of each kernel path, fewer compiles
        variants = [v for v in variants if "SmolLM2" not in v[0] and "fp32" not in v[0]]
    failed = False
    print("| variant | kernel | config | regs | spill stack B | smem B | compile s |")
    print("|---|---|---|---|---|---|---|")
    for name, (cfg, launches), spills_ok in variants:
        for kernel, _grid, args, constexprs, options in launches:
            start = time.time()
            try:
                compiled = _compile(kernel, args, constexprs, options, target)
            except (CompilationError, TritonError, RuntimeError) as exc:   # the kernel fails to build
                if "ptxas" in str(exc) and "not found" in str(exc).lower():
                    print(f"cannot check: {exc}")
                    return 3
                print(f"| {name} | {kernel.fn.__name__} | FAILED: {type(exc).__name__}: {exc} |")
                failed = True
                continue
            except Exception as exc:          # a Triton whose private compile API differs
                print(f"cannot check with triton {triton.__version__}: {type(exc).__name__}: {exc}")
                return 3
            res = _resources(compiled)
            cfg_text = "x".join(map(str, cfg)) if cfg != "-" else "-"
            print(f"| {name} | {kernel.fn.__name__} | {cfg_text} | {res['regs']} | {res['stack']} "
                  f"| {res['smem']} | {time.time() - start:.1f} |", flush=True)
            if res["stack"] != 0 and not spills_ok:
                failed = True
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# GPU benchmark


class Report:
    def __init__(self, out_dir: str | None):
        self.lines: list[str] = []
        self.path = Path(out_dir) / "bench_attention.md" if out_dir else None

    def add(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n")


def _bench(fn) -> float:
    """Median milliseconds per call."""
    if DRY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _paged_inputs(batch: int, ctx: int, query_len: int, seed=0):
    """A cache holding `batch` sequences of `ctx` tokens in shuffled blocks, and their queries."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, HKV, D)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    qsl = (torch.arange(batch + 1, device=DEVICE) * query_len).int()
    q = torch.randn(batch * query_len, HQ, D, device=DEVICE, dtype=DTYPE, generator=gen)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def correctness(report: Report) -> bool:
    """bf16 against the float64 loop on a mixed batch, with and without split-KV."""
    from pagoda.kernels import reference as ref
    from pagoda.kernels import triton_attention as ta
    report.add("", f"## {DTYPE} correctness (max abs error against float64)", "",
               "| case | split | max err | ok |", "|---|---|---|---|")
    ok_all = True
    _, k, v, tables, _, _ = _paged_inputs(4, 700, 1, seed=1)
    seq_lens = torch.tensor([700, 33, 500, 64], dtype=torch.int32, device=DEVICE)
    for name, q_lens in (("decodes", [1, 1, 1, 1]), ("decodes and prefill chunks", [1, 33, 1, 20])):
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
        q = torch.randn(starts[-1], HQ, D, device=DEVICE, dtype=DTYPE)
        want = ref.paged_attention_float64(q.cpu(), k.cpu(), v.cpu(), tables.cpu(),
                                           seq_lens.cpu(), qsl.cpu(), D ** -0.5)
        for splits in (None, 1, 4):
            out = torch.full_like(q, float("nan"))
            ta.paged_attention(q, k, v, tables, seq_lens, qsl, D ** -0.5, max_seq_len=700,
                               max_query_len=max(q_lens), out=out, num_kv_splits=splits)
            err = (out.double().cpu() - want).abs().max().item()
            ok = err <= 3e-2 and not out.isnan().any()
            ok_all &= ok
            report.add(f"| {name}, GQA {HQ // HKV} | {splits or 'auto'} | {err:.2e} | {ok} |")
    return ok_all


def copy_bandwidth() -> float:
    nbytes = (1 << 20) if DRY else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)                                  # read + write


def decode_table(report: Report, copy_bw: float) -> None:
    from pagoda.kernels import triton_attention as ta
    report.add("", f"## Decode: KV bytes read per second ({DTYPE}, {HQ} q heads, {HKV} kv heads, "
               f"D={D}, block {BLOCK_SIZE})", "",
               f"Device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write).", "",
               "| B | context | segments | time us | GB/s | of copy | goal |",
               "|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        for ctx in CONTEXTS:
            q, k, v, tables, seq_lens, qsl = _paged_inputs(batch, ctx, 1)
            out = torch.empty_like(q)
            cfg = ta.choose_config(HQ, HKV, D, q.dtype, batch, ctx, 1, ta._num_sms(q.device))
            ms = _bench(lambda: ta.paged_attention(q, k, v, tables, seq_lens, qsl, D ** -0.5,
                                                   max_seq_len=ctx, max_query_len=1, out=out))
            nbytes = 2 * batch * ctx * HKV * D * k.element_size() + 2 * q.numel() * q.element_size()
            bw = nbytes / (ms * 1e-3)
            goal = "-"
            if batch >= 32 and ctx >= 4096:
                goal = "pass" if bw >= DECODE_GOAL * copy_bw else "MISS"
            report.add(f"| {batch} | {ctx} | {cfg.num_segments} | {ms * 1e3:.1f} | {bw / 1e9:.0f} "
                       f"| {bw / copy_bw:.0%} | {goal} |")
            del q, k, v, tables, out
            torch.cuda.empty_cache()


def _sdpa(q4, k4, v4):
    """torch's fastest fused causal attention (never the math backend, which would need the
    whole score matrix in memory)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         getattr(SDPBackend, "CUDNN_ATTENTION", None)) if b is not None]
    with sdpa_kernel(fused if not DRY else [SDPBackend.MATH]):
        try:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):                # old torch, or no fused GQA kernel
            rep = q4.shape[1] // k4.shape[1]
            return F.scaled_dot_product_attention(q4, k4.repeat_interleave(rep, 1),
                                                  v4.repeat_interleave(rep, 1), is_causal=True)


def prefill_table(report: Report) -> None:
    from pagoda.kernels import triton_attention as ta
    report.add("", f"## Prefill of whole contexts against SDPA (causal, {DTYPE}, {HQ}/{HKV} heads, "
               f"D={D}; B x context <= {PREFILL_MAX_TOKENS})", "",
               "| B | context | paged ms | paged TFLOP/s | SDPA ms | SDPA TFLOP/s | paged/SDPA speed "
               "| max diff | goal |", "|---|---|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        for ctx in CONTEXTS:
            if batch * ctx > PREFILL_MAX_TOKENS:
                continue
            q, k, v, tables, seq_lens, qsl = _paged_inputs(batch, ctx, ctx)
            out = torch.empty_like(q)
            ms = _bench(lambda: ta.paged_attention(q, k, v, tables, seq_lens, qsl, D ** -0.5,
                                                   max_seq_len=ctx, max_query_len=ctx, out=out))
            # The same keys, contiguous, for SDPA: [B, heads, ctx, D].
            order = tables.long().view(batch, -1)
            k4 = k[order].view(batch, -1, HKV, D)[:, :ctx].transpose(1, 2)
            v4 = v[order].view(batch, -1, HKV, D)[:, :ctx].transpose(1, 2)
            q4 = q.view(batch, ctx, HQ, D).transpose(1, 2)
            sdpa_ms = _bench(lambda: _sdpa(q4, k4, v4))
            diff = (_sdpa(q4, k4, v4).transpose(1, 2).reshape_as(out) - out).abs().max().item()
            flops = 4 * batch * HQ * D * ctx * (ctx + 1) / 2
            speed = sdpa_ms / ms
            goal = "pass" if speed >= PREFILL_GOAL else "MISS"
            report.add(f"| {batch} | {ctx} | {ms:.2f} | {flops / ms / 1e9:.0f} | {sdpa_ms:.2f} "
                       f"| {flops / sdpa_ms / 1e9:.0f} | {speed:.2f}x | {diff:.1e} | {goal} |")
            del q, k, v, tables, out, k4, v4, q4
            torch.cuda.empty_cache()


def sweeps(report: Report, deadline: float) -> None:
    """Alternative tile configs on two shapes, to tune choose_config on this GPU."""
    from pagoda.kernels import triton_attention as ta
    C = ta.AttentionConfig
    group = HQ // HKV
    decode = [C(16, 16 // group, n, s, w, st) for n in (32, 64, 128) for s in (1, 4, 8)
              for w, st in ((4, 3), (4, 4), (8, 3))][:18]
    prefill = [C(m, m // group, n, 1, w, st) for m, n, w, st in (
        (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
        (64, 128, 4, 2), (128, 64, 4, 3), (256, 64, 8, 2))]
    big, long = (2, 70) if DRY else (32, 4096)
    for title, (batch, ctx, qlen), configs in (
            (f"decode B={big}, context {long}", (big, long, 1), decode),
            (f"prefill B={big // 4 or 1}, context {long}", (big // 4 or 1, long, long), prefill)):
        q, k, v, tables, seq_lens, qsl = _paged_inputs(batch, ctx, qlen)
        out = torch.empty_like(q)
        default = ta.choose_config(HQ, HKV, D, q.dtype, batch, ctx, qlen, ta._num_sms(q.device))
        report.add("", f"## Config sweep: {title} (default {tuple(default)})", "",
                   "| block_m | block_q | block_n | segments | warps | stages | time us |",
                   "|---|---|---|---|---|---|---|")
        results = []
        for cfg in [default] + configs:
            if time.time() > deadline:
                report.add("| (time budget reached) |")
                break
            try:
                ms = _bench(lambda: ta.paged_attention(q, k, v, tables, seq_lens, qsl, D ** -0.5,
                                                       out=out, config=cfg))
            except Exception as exc:                                   # e.g. out of shared memory
                report.add(f"| {' | '.join(map(str, cfg))} | failed: {type(exc).__name__} |")
                continue
            results.append((ms, cfg))
            report.add(f"| {' | '.join(map(str, cfg))} | {ms * 1e3:.1f} |")
        if results:
            best = min(results)
            report.add("", f"Best: {tuple(best[1])} at {best[0] * 1e3:.1f} us.")
        del q, k, v, tables, out
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-check", nargs="?", const="all", choices=["all", "quick"])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds after which the config sweeps stop")
    args = parser.parse_args()
    if args.compile_check:
        return compile_check(quick=args.compile_check == "quick")
    if not DRY and not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure (try --compile-check)")
        return 3
    start = time.time()
    report = Report(args.out)
    report.add(f"# Attention kernels on {'CPU (dry run)' if DRY else torch.cuda.get_device_name()}",
               f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    ok = correctness(report)
    copy_bw = copy_bandwidth()
    decode_table(report, copy_bw)
    prefill_table(report)
    sweeps(report, deadline=start + args.budget)
    report.add("", f"Total {time.time() - start:.0f} s.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
