"""What a worker measures of itself at start-up, through its real step path: a CUDA worker's
peak memory for the largest batch (the KV cache gets the rest), the prefill rate the
scheduler's deadlines use, whether the CPU decode attention should prefetch its blocks, and how
many decodes a step may have for the one-C-call step to pay (the last three kept per machine
and configuration, worker/startup/kept.py). Each reads the
runner's model, cache and flags and runs dummy forwards; none changes what the runner holds."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pagoda.kernels import cbuild, cpu_decode_attention, cpu_decode_layer
from proto import internal_pb2
from worker.model import fused_decode, layers
from worker.model.cpu_matmul import bound
from worker.model.kv_cache import CacheEngine
from worker.step.input_batch import InputBatch
from worker.startup.kept import how, kept, machine_key, timed
from worker.worker_flags import DECODE_STEP_TOKENS


def dummy_forward(runner, num_tokens: int, kv_caches, num_blocks: int) -> int:
    """A prefill of num_tokens through the real step path, split into sequences that fit
    max_model_len and the given cache; every sequence samples so the logits path runs too."""
    batch = InputBatch(runner.max_model_len, runner.block_size)
    counts, left, block = [], num_tokens, 0
    while left > 0:
        n = min(left, runner.max_model_len)
        need = -(-n // runner.block_size)
        if block + need > num_blocks:
            break
        batch.add(len(counts), [0] * n, range(block, block + need), 0, n,
                  internal_pb2.SamplingConfig())
        counts.append(n)
        block, left = block + need, left - n
    if not counts:
        return 0
    inputs = runner.prepare_inputs(np.arange(len(counts)), np.array(counts), batch)
    hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta, kv_caches)
    if runner.tp.rank == 0:
        runner.model.compute_logits(hidden[inputs.logits_indices]).argmax(-1).tolist()
    return num_tokens - left


@torch.inference_mode()
def profile_peak_memory(runner) -> int:
    """Peak bytes of weights + activations of the largest batch (CUDA), the KV cache excluded,
    plus what CUDA itself holds outside torch's allocator (context, cuBLAS workspaces)."""
    tokens = runner.args.max_num_batched_tokens
    num_blocks = -(-tokens // runner.block_size) + -(-tokens // runner.max_model_len)
    scratch = CacheEngine(runner.config, num_blocks, 0, runner.block_size, runner.dtype, runner.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    dummy_forward(runner, tokens, scratch.kv_caches, num_blocks)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - scratch.device_cache.nbytes
    free, total = torch.cuda.mem_get_info(runner.device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(runner.device))
    del scratch
    torch.cuda.empty_cache()
    return peak + outside_torch


@torch.inference_mode()
def measure_prefill(runner) -> float:
    """Tokens per second of one prefill, after a small forward that pays one-time costs (every
    start: the first request must not pay them). Kept per machine and configuration
    (worker/startup/kept.py): the next start skips the timed prefill, about half a second on a CPU."""
    num_blocks = runner.cache.num_blocks
    tokens = min(runner.args.max_num_batched_tokens, 256 if runner.device.type == "cpu" else 2048,
                 num_blocks * runner.block_size)
    dummy_forward(runner, min(16, tokens), runner.cache.kv_caches, num_blocks)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda *a: None)

    def timed() -> dict:
        sync()
        start = time.perf_counter()
        done = dummy_forward(runner, tokens, runner.cache.kv_caches, num_blocks)
        sync()
        return {"tokens_per_s": done / max(time.perf_counter() - start, 1e-9)}

    if runner.tp.size > 1:  # the ranks' forwards meet in collectives: all of them time it, always
        return timed()["tokens_per_s"]
    device = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu"
    key = machine_key(device, runner.config, runner.dtype, runner.args.quantization,
                      runner.backend.name, tokens, layers.CPU)
    return kept("prefill", key, timed, {"tokens_per_s"}, runner.args.measure_again)[0]["tokens_per_s"]


PREFETCH_ROWS = 32  # decode rows of the timed attention: a batch's step
PREFETCH_CONTEXTS = (200, 600)  # their contexts, drawn in this range (bench/bench_cpu_attention.py --decode)
PREFETCH_PAIRS = 7  # timed pairs of calls (prefetch off, on) over every layer's cache
PREFETCH_MARGIN = 0.03  # off must save this share to be chosen: a tie keeps the kernel's prefetch


@torch.inference_mode()
def measure_attention_prefetch(runner) -> None:
    """Sets whether kernels/csrc/cpu_decode_attention.c (and the one-C-call step's attention)
    requests the blocks ahead of the one it reads or leaves them to the hardware prefetchers: the
    machine's. On a Zen 5 EPYC the prefetch sped 64 rows up (fp32 56 -> 50 ms a step, bf16 48 ->
    26); on a Zen 2 EPYC, with the cache in huge pages, it slows fp32 by a tenth (32 rows: 52 against
    46 ms) while bf16 needs it (35 against 46; docs/benchmarks-history.md, "Stop 46"). Timed on the real
    cache (its huge pages, every layer's blocks, scattered tables), PREFETCH_ROWS rows, off and on
    back to back; kept per machine, model, cache dtype and kernel build."""
    k_cache = runner.cache.kv_caches[0][0]
    if runner.device.type != "cpu" or not cpu_decode_attention.runs_on(k_cache):
        return
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(*PREFETCH_CONTEXTS, (PREFETCH_ROWS,), generator=g, dtype=torch.int32)
    need = [-(-int(n) // runner.block_size) for n in lens]
    started = time.perf_counter()
    if sum(need) > runner.cache.num_blocks:
        said = "the default: the KV cache is too small to time it in"
    else:
        def timings() -> dict:
            order = torch.randperm(runner.cache.num_blocks, generator=g)[:sum(need)].to(torch.int32)
            tables = torch.zeros(PREFETCH_ROWS, max(need), dtype=torch.int32)
            for i, (at, n) in enumerate(zip(np.cumsum([0] + need[:-1]), need)):
                tables[i, :n] = order[at:at + n]
            _, _, kv_heads, head_dim = k_cache.shape  # this rank's
            q_heads = kv_heads * (runner.config.num_heads // runner.config.num_kv_heads)
            q = torch.randn(PREFETCH_ROWS, q_heads, head_dim, generator=g)
            out, rows, scale = torch.empty_like(q), torch.arange(PREFETCH_ROWS), head_dim ** -0.5

            def attend(ahead: bool) -> float:
                start = time.perf_counter()
                for k, v in runner.cache.kv_caches:
                    cpu_decode_attention.decode(q, k, v, rows, lens, tables, scale, out, ahead=ahead)
                return time.perf_counter() - start

            attend(False), attend(True)  # one-time costs
            ratios = [attend(False) / max(attend(True), 1e-9) for _ in range(PREFETCH_PAIRS)]
            return {"prefetch": statistics.median(ratios) > 1 - PREFETCH_MARGIN}

        build = cbuild.library_path(cpu_decode_attention.SOURCE, cpu_decode_attention.FLAGS).name
        key = machine_key(runner.config, k_cache.dtype, runner.block_size, build,
                          f"rows={PREFETCH_ROWS}", f"contexts={PREFETCH_CONTEXTS}")
        found, was_kept = kept("attention-prefetch", key, timings, {"prefetch"}, runner.args.measure_again)
        cpu_decode_attention.prefetch, said = found["prefetch"], how(was_kept, started)
    fused_decode.log.info("decode attention %s (%s)", "prefetches the blocks ahead" if cpu_decode_attention.prefetch
                          else "leaves the blocks ahead to the hardware prefetchers", said)


DECODE_CONTEXT = 128  # tokens each timed sequence has in the cache (zeros)
DECODE_PAIRS = 7  # timed pairs of steps (one C call, layer by layer) per sequence count


@torch.inference_mode()
def measure_decode_step_bound(runner) -> None:
    """Sets how many decodes a step may have for a dense model's one-C-call step
    (worker/model/fused_decode.py): --cpu-decode-step-tokens, else the count of DECODE_STEP_TOKENS up to
    which it beats the layers one by one here, each count's steps timed back to back, alternating;
    and for bf16 weights, whether steps of fewer than BF16_DOT_MIN_TOKENS tokens take the dot
    products (kernels/cpu_decode_layer.py few_rows_dot), timed at one token first, with the flag
    too (it pins the bound only: without the timing an AMX Xeon's single stream took the widened
    weights, 14.7 ms a token against 11.8).
    The bound is the machine's: 8 paid on a Zen 3 EPYC in fp32 and bf16, 4 on a Zen 5
    (docs/benchmarks-history.md, "Stop 41"). Kept per machine and configuration."""
    step = getattr(runner.model.model, "fused_decode", None)
    if step is None or not step.dense:
        return
    need = -(-(DECODE_CONTEXT + 1) // runner.block_size)
    most = max(DECODE_STEP_TOKENS)

    def timings(with_bound: bool = True) -> dict:
        batch = InputBatch(runner.max_model_len, runner.block_size)
        for i in range(most):
            batch.add(i, [0] * (DECODE_CONTEXT + 1), range(i * need, (i + 1) * need), DECODE_CONTEXT,
                      DECODE_CONTEXT + 1, internal_pb2.SamplingConfig())
        for k_cache, v_cache in runner.cache.kv_caches:  # zeros, not whatever the memory held
            k_cache[:most * need].zero_()
            v_cache[:most * need].zero_()
        previous, step.max_tokens = step.max_tokens, most

        def median_ratio(n: int, flip) -> float:  # flip(True) / flip(False), n tokens, back to back
            inputs = runner.prepare_inputs(np.arange(n), np.ones(n, dtype=np.int64), batch)
            times = {True: [], False: []}
            for i in range(DECODE_PAIRS + 1):
                for on in (True, False):
                    flip(on)
                    start = time.perf_counter()
                    runner.model(inputs.input_ids, inputs.positions, inputs.meta, runner.cache.kv_caches)
                    if i:  # the first pair pays one-time costs
                        times[on].append(time.perf_counter() - start)
            return statistics.median(times[True]) / statistics.median(times[False])

        def few_rows_dot(on: bool) -> None:
            cpu_decode_layer.few_rows_dot = on

        def step_on(on: bool) -> None:
            fused_decode.enabled = on
        try:
            dots = (step.shape.kind == "bf16" and cpu_decode_layer.bf16_dot_here() > 0
                    and median_ratio(1, few_rows_dot) < 1)
            few_rows_dot(dots)
            most_tokens = bound(DECODE_STEP_TOKENS, lambda n: median_ratio(n, step_on)) if with_bound else 0
            return {"bf16_few_rows_dot": dots, "max_tokens": most_tokens}
        finally:
            fused_decode.enabled, step.max_tokens = True, previous

    started = time.perf_counter()
    pinned = runner.args.cpu_decode_step_tokens  # the bound, not timed; the products still are
    if most * need > runner.cache.num_blocks:
        said = "the default: the KV cache is too small to time it in"
    else:
        build = cbuild.library_path(cpu_decode_layer.SOURCE, cpu_decode_layer.FLAGS).name
        key = machine_key(runner.config, runner.dtype, step.shape.kind, DECODE_CONTEXT, layers.CPU, build,
                          f"prefetch={cpu_decode_attention.prefetch}",
                          timed(DECODE_STEP_TOKENS) if pinned is None else "products only")
        found, was_kept = kept("decode-step", key, lambda: timings(pinned is None),
                               {"max_tokens", "bf16_few_rows_dot"}, runner.args.measure_again)
        step.max_tokens, said = found["max_tokens"], how(was_kept, started)
        cpu_decode_layer.few_rows_dot = found["bf16_few_rows_dot"]
    if pinned is not None:
        step.max_tokens, said = pinned, "--cpu-decode-step-tokens"
    fused_decode.log.info("decode steps of up to %d tokens run as one C call (%s)%s", step.max_tokens, said,
                          ", bf16 products of 1-4 tokens in dot products" if cpu_decode_layer.few_rows_dot else "")
