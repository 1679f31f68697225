"""What a worker measures of itself at start-up, through its real step path: a CUDA worker's
peak memory for the largest batch (the KV cache gets the rest), and the prefill rate the
scheduler's deadlines use (kept per machine and configuration, worker/kept.py). Each reads the
runner's model, cache and flags and runs dummy forwards; none changes what the runner holds."""
from __future__ import annotations

import time

import numpy as np
import torch

from proto import internal_pb2
from worker import layers
from worker.cache import CacheEngine
from worker.input_batch import InputBatch
from worker.kept import kept, machine_key


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
    (worker/kept.py): the next start skips the timed prefill, about half a second on a CPU."""
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

