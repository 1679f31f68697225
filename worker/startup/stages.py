"""A worker's start-up, in its order: load the weights and build the model, size and allocate the
KV cache, measure what the scheduler plans with (worker/startup/measurements.py). Each stage
sets what it makes on the runner, which the next one reads (the measurements run dummy steps
through the runner's own path)."""
from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from process_life.flag_errors import FlagError
from worker.model.attention_backends import select_backend
from worker.model.kv_cache import CacheEngine, bytes_per_block, num_device_blocks
from worker.model.eos import eos_token_ids
from worker.startup.host_memory import keep_freed_memory
from worker.model.layers import use_cpu_kernel, use_quantized_kernel
from worker.model.loader import load_weights
from worker.model.llama import build_model, projection_shapes
from worker.parallel.tensor_parallel import shard_config
from worker.speculation.speculator import build_speculator
from worker.startup.measurements import (measure_attention_prefetch, measure_decode_step_bound, measure_prefill,
                                         profile_peak_memory)

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2**30
MAX_DEFAULT_MODEL_LEN = 8192


def start_up(runner) -> None:
    """Loads, sizes, measures: the runner's model, speculator, cache and measured rates."""
    # A progress bar where a person watches (a terminal); the log lines say the same.
    progress = tqdm(total=5, desc=f"worker {runner.worker_id}", unit="stage", disable=None,
                    bar_format="{desc}: {n}/{total} {postfix} [{elapsed}]")
    stage = progress.set_postfix_str
    stage("loading weights")
    start = time.perf_counter()
    runner.config, weights = load_weights(runner.model_path)
    progress.update()
    stage("building the model")
    build(runner, weights)
    del weights  # before quantizing: the dense weights and the quantized ones need not coexist
    if runner.args.quantization:
        quantize(runner)
    progress.update()
    runner.load_seconds = time.perf_counter() - start
    runner.eos_token_ids = eos_token_ids(runner.model_path, runner.config.eos_token_ids)
    if not runner.eos_token_ids:
        logger.warning("%s names no end-of-sequence token: answers end only at max_tokens, "
                       "a stop id or a stop string", runner.model_path)

    runner.speculator = build_speculator(getattr(runner.args, "speculative_config", None), runner)
    stage("sizing the KV cache")
    allocate_kv_cache(runner)
    progress.update()
    stage("measuring swap bandwidth")
    runner.swap_bytes_per_s = runner.cache.measure_swap_bandwidth()
    progress.update()
    stage("warming up (one prefill)")
    runner.prefill_tokens_per_s = measure_prefill(runner)
    measure_attention_prefetch(runner)
    measure_decode_step_bound(runner)
    progress.update()
    progress.close()


def build(runner, weights: dict[str, torch.Tensor]) -> None:
    """The model of this rank's share (every head without a group), its length and kernels."""
    args, config = runner.args, runner.config
    trained_len = config.max_position_embeddings
    runner.max_model_len = args.max_model_len or min(trained_len, MAX_DEFAULT_MODEL_LEN)
    if why := config.context_refusal(args.max_model_len, args.allow_long_max_model_len):
        raise FlagError(why)
    if runner.max_model_len > trained_len:
        logger.warning("--max-model-len %d is beyond the %d positions the model was trained on "
                       "(--allow-long-max-model-len)", runner.max_model_len, trained_len)
    runner.backend = select_backend(args.attention_backend, runner.device.type)
    runner.shard = shard = shard_config(config, runner.tp.size)
    if runner.device.type == "cpu":
        keep_freed_memory()
        use_cpu_kernel(args.cpu_matmul == "auto", (shard.intermediate_size, shard.hidden_size), runner.dtype,
                       args.measure_again)
        if args.quantization:
            use_quantized_kernel(args.cpu_matmul == "auto", projection_shapes(shard),
                                 args.quantization, args.measure_again,
                                 vocab_shape=(config.vocab_size, shard.hidden_size))
    runner.model = build_model(shard, weights, runner.backend, runner.max_model_len, runner.device,
                               runner.dtype, runner.tp,
                               # a quantized model builds its own (LlamaForCausalLM.quantize_gguf)
                               fused_decode=args.cpu_matmul == "auto" and not args.quantization)


def quantize(runner) -> None:
    args = runner.args
    if runner.device.type != "cpu" or runner.dtype != torch.float32 or runner.tp.size != 1:
        raise FlagError(f"--quantization {args.quantization} runs on the CPU, with --dtype "
                        "float32, on one rank")
    logger.info("%s weights: %.0f MB", args.quantization,
                runner.model.quantize(args.quantization, runner.model_path) / 1e6)


def allocate_kv_cache(runner) -> None:
    """The KV cache in what the flags leave after the model (a CUDA worker profiles its peak)."""
    args, speculator = runner.args, runner.speculator
    # A draft model's cache has a block for each of the target's, in the same budget.
    block_bytes = bytes_per_block(runner.shard, runner.block_size, runner.dtype) + (
        speculator.draft_bytes_per_block(runner.block_size) if speculator else 0)
    peak = profile_peak_memory(runner) if runner.device.type == "cuda" else 0
    num_blocks = num_device_blocks(
        override=args.num_gpu_blocks_override, device=runner.device, block_bytes=block_bytes,
        kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES,
        gpu_memory_utilization=args.gpu_memory_utilization, profiled_peak_bytes=peak)
    # One block pool for the whole group: block i exists on every rank (each with its heads).
    num_blocks = runner.tp.min_over_ranks(num_blocks)
    num_cpu_blocks = int(args.swap_space * 2**30) // block_bytes
    runner.cache = CacheEngine(runner.shard, num_blocks, num_cpu_blocks, runner.block_size, runner.dtype,
                               runner.device)
    if speculator:
        speculator.allocate_draft_cache(num_blocks, runner.block_size)
