"""ModelRunner: executes the scheduler's StepPlans against the model and the paged KV cache.

The worker mirrors the scheduler's view of each sequence (tokens, blocks, computed count) so that
a plan only has to carry the diff; see proto/internal.proto for the meaning of each field.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from itertools import chain

import torch

from kernels.select import select_backend
from launch.models import model_display_name, resolve_model
from proto import internal_pb2
from proto.auth import PROTOCOL_VERSION
from worker.checks import check_plan
from proto.columns import pack, pack_f32, unpack_list
from worker.args import default_worker_id
from worker.attention import AttentionMetadata
from worker.cache import CacheEngine, bytes_per_block, num_device_blocks
from worker.eos import eos_token_ids
from worker.loader import load_weights
from worker.model import build_model
from worker.platform import resolve_device, resolve_dtype
from worker.logits import compute_logprobs
from worker.sampler import Sampler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2**30
MAX_DEFAULT_MODEL_LEN = 8192
# Prompt logprobs take a [rows, vocab] logits tensor: bound it (49152 x 512 floats = 100 MB).
PROMPT_LOGPROBS_ROWS = 512


@dataclass
class SeqState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: internal_pb2.SamplingConfig
    num_prompt_tokens: int = 0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # int64 [num_sampling_seqs], rows of the hidden states to sample
    sample_positions: list[int]    # index in its sequence of each token to be sampled


class ModelRunner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_id = args.worker_id or default_worker_id()
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.block_size = args.block_size
        self.model_path = resolve_model(args.model)

        start = time.perf_counter()
        self.config, weights = load_weights(self.model_path)
        trained_len = self.config.max_position_embeddings
        self.max_model_len = args.max_model_len or min(trained_len, MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > trained_len:
            logger.warning("--max-model-len %d is beyond the %d positions the model was trained on",
                           self.max_model_len, trained_len)
        self.backend = select_backend(args.attention_backend, self.device.type)
        self.model = build_model(self.config, weights, self.backend, self.max_model_len, self.device,
                                 self.dtype)
        del weights
        self.load_seconds = time.perf_counter() - start
        self.eos_token_ids = eos_token_ids(self.model_path, self.config.eos_token_ids)
        if not self.eos_token_ids:
            logger.warning("%s names no end-of-sequence token: answers end only at max_tokens, "
                           "a stop id or a stop string", self.model_path)

        block_bytes = bytes_per_block(self.config, self.block_size, self.dtype)
        peak = self._profile_peak_memory() if self.device.type == "cuda" else 0
        num_blocks = num_device_blocks(
            override=args.num_gpu_blocks_override, device=self.device, block_bytes=block_bytes,
            kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES,
            gpu_memory_utilization=args.gpu_memory_utilization, profiled_peak_bytes=peak)
        num_cpu_blocks = int(args.swap_space * 2**30) // block_bytes
        self.cache = CacheEngine(self.config, num_blocks, num_cpu_blocks, self.block_size, self.dtype,
                                 self.device)
        self.swap_bytes_per_s = self.cache.measure_swap_bandwidth()
        self.prefill_tokens_per_s = self._measure_prefill()

        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(args.seed))
        self.seqs: dict[int, SeqState] = {}  # by slot
        logger.info("worker %s ready: %s %s on %s, %d blocks of %d (+%d cpu), load %.1fs, prefill %.0f tok/s",
                    self.worker_id, self.config.architecture, self.dtype, self.device, num_blocks,
                    self.block_size, num_cpu_blocks, self.load_seconds, self.prefill_tokens_per_s)

    # ------------------------------------------------------------------ the contract

    def hello(self) -> internal_pb2.WorkerHello:
        device = str(self.device)
        if self.device.type == "cuda":
            device += f" ({torch.cuda.get_device_name(self.device)})"
        return internal_pb2.WorkerHello(
            worker_id=self.worker_id,
            model=model_display_name(self.model_path),
            num_blocks=self.cache.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=device,
            vocab_size=self.config.vocab_size,
            num_cpu_blocks=self.cache.num_cpu_blocks,
            bytes_per_block=self.cache.block_bytes,
            swap_bytes_per_s=self.swap_bytes_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            eos_token_ids=self.eos_token_ids,
            no_eos=not self.eos_token_ids,
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            protocol_version=PROTOCOL_VERSION,
        )

    def execute(self, plan: internal_pb2.StepPlan) -> internal_pb2.StepResult:
        result = internal_pb2.StepResult(step_id=plan.step_id)
        start = time.perf_counter()
        if why := check_plan(plan, self.cache.num_blocks, self.cache.num_cpu_blocks,
                             self.config.vocab_size):
            logger.error("refused step %d: %s", plan.step_id, why)
            result.error = f"bad plan: {why}"
            return result
        try:
            with torch.inference_mode():
                self._execute(plan, result)
        except Exception as e:  # the process must outlive a bad plan; the scheduler aborts the step
            logger.exception("step %d failed", plan.step_id)
            result.slots = result.token_ids = b""
            del result.logprobs[:]
            result.error = f"{type(e).__name__}: {e}"
        result.forward_seconds = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------ one step

    def _execute(self, plan: internal_pb2.StepPlan, result: internal_pb2.StepResult) -> None:
        for slot in plan.dropped_slots:
            self.seqs.pop(slot, None)
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy(plan.copy)

        scheduled: list[tuple[int, SeqState, int]] = []
        for new in plan.new_seqs:
            sampling = internal_pb2.SamplingConfig()
            sampling.CopyFrom(new.sampling)
            state = SeqState(list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                             sampling, new.num_prompt_tokens)
            self.seqs[new.slot] = state
            if new.num_new_tokens:
                scheduled.append((new.slot, state, new.num_new_tokens))
        seqs = self.seqs
        for slot, block in zip(unpack_list(plan.new_block_slots), unpack_list(plan.new_block_ids)):
            self._held(slot).block_ids.append(block)
        for slot, n in zip(unpack_list(plan.running_slots), unpack_list(plan.running_num_tokens)):
            if n:
                scheduled.append((slot, seqs.get(slot) or self._held(slot), n))
        if not scheduled:
            return

        seqs = [(state, n) for _, state, n in scheduled]
        inputs = self.prepare_inputs(seqs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache.kv_caches)
        sampling_rows = [(slot, state) for slot, state, n in scheduled
                         if state.num_computed_tokens + n == len(state.token_ids)]
        self._prompt_logprobs(scheduled, hidden, result)
        tokens: list[int] = []
        if sampling_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            states = [state for _, state in sampling_rows]
            sampled = self.sampler(logits, [s.sampling for s in states], inputs.sample_positions,
                                   [s.token_ids for s in states], [s.num_prompt_tokens for s in states])
            self._sampled_logprobs(sampling_rows, logits, sampled, inputs.sample_positions, result)
            tokens = sampled.tolist()
        for _, state, n in scheduled:
            state.num_computed_tokens += n
        for (slot, state), token in zip(sampling_rows, tokens):
            state.token_ids.append(token)  # the scheduler appends the same token on its side
        result.slots = pack([slot for slot, _ in sampling_rows])
        result.token_ids = pack(tokens)

    def _sampled_logprobs(self, rows, logits, sampled, positions, result) -> None:
        """Logprobs of the sampled tokens, for the sequences that asked."""
        asking = [i for i, (_, s) in enumerate(rows) if s.sampling.HasField("logprobs")]
        if not asking:
            return
        index = torch.tensor(asking, device=logits.device)
        ks = [rows[i][1].sampling.logprobs for i in asking]
        chosen = sampled[index]
        lps = compute_logprobs(logits[index], chosen, max(ks))
        for j, (i, k) in enumerate(zip(asking, ks)):
            result.logprobs.append(
                logprobs_message(rows[i][0], False, positions[i], chosen, lps, j, j + 1, k))

    def _prompt_logprobs(self, scheduled, hidden, result) -> None:
        """Logprobs of the prompt tokens this step computed, for the sequences that asked: the
        row of position p scores the prompt token at p + 1. The last prompt position scores the
        first output token instead, which is sampled, not scored here."""
        offset = 0
        for slot, state, n in scheduled:
            start, stop = state.num_computed_tokens, state.num_computed_tokens + n
            if state.sampling.HasField("prompt_logprobs"):
                k = state.sampling.prompt_logprobs
                for lo in range(start, min(stop, state.num_prompt_tokens - 1), PROMPT_LOGPROBS_ROWS):
                    hi = min(lo + PROMPT_LOGPROBS_ROWS, stop, state.num_prompt_tokens - 1)
                    logits = self.model.compute_logits(hidden[offset + lo - start:offset + hi - start])
                    targets = torch.tensor(state.token_ids[lo + 1:hi + 1], device=logits.device)
                    lps = compute_logprobs(logits, targets, k)
                    result.logprobs.append(
                        logprobs_message(slot, True, lo + 1, targets, lps, 0, hi - lo, k))
            offset += n

    def _held(self, slot: int) -> SeqState:
        state = self.seqs.get(slot)
        if state is None:
            raise KeyError(f"running slot {slot} is unknown to this worker")
        return state

    def prepare_inputs(self, seqs: list[tuple[SeqState, int]]) -> ModelInputs:
        """Flatten the step: each sequence contributes tokens [num_computed, num_computed + n)."""
        bs = self.block_size
        starts, lens, sample_rows, sample_positions = [], [], [], []
        end = 0
        for state, n in seqs:
            start = state.num_computed_tokens
            if start + n > len(state.token_ids):
                raise ValueError(f"{n} new tokens from {start} run past the "
                                 f"{len(state.token_ids)} tokens known")
            if start + n > len(state.block_ids) * bs:
                raise ValueError(f"{start + n} tokens do not fit in {len(state.block_ids)} blocks")
            if start + n > self.max_model_len:
                raise ValueError(f"{start + n} tokens exceed max_model_len {self.max_model_len}")
            starts.append(start)
            lens.append(n)
            end += n
            if start + n == len(state.token_ids):
                sample_rows.append(end - 1)
                sample_positions.append(start + n)
        ids = list(chain.from_iterable(s.token_ids[st:st + n] for (s, n), st in zip(seqs, starts)))
        width = max(len(s.block_ids) for s, _ in seqs)
        tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s, _ in seqs]

        input_ids = torch.tensor(ids, dtype=torch.int64)
        block_tables = torch.tensor(tables, dtype=torch.int32)
        query_lens = torch.tensor(lens, dtype=torch.int64)
        start_pos = torch.tensor(starts, dtype=torch.int64)
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        # Token t of sequence s sits at position start_s + (t - query_start_s).
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
        positions = torch.arange(len(ids)) + (start_pos - query_start_loc[:-1])[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // bs].long() * bs + positions % bs

        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(slot_mapping),
            block_tables=to(block_tables),
            seq_lens=to((start_pos + query_lens).int()),
            query_start_loc=to(query_start_loc.int()),
            max_seq_len=max(st + n for st, n in zip(starts, lens)),
            max_query_len=max(lens),
        )
        return ModelInputs(to(input_ids), to(positions), meta,
                           to(torch.tensor(sample_rows, dtype=torch.int64)), sample_positions)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ start-up measurements

    def _dummy_forward(self, num_tokens: int, kv_caches, num_blocks: int) -> int:
        """A prefill of num_tokens through the real step path, split into sequences that fit
        max_model_len and the given cache; every sequence samples so the logits path runs too."""
        seqs, left, block = [], num_tokens, 0
        while left > 0:
            n = min(left, self.max_model_len)
            need = -(-n // self.block_size)
            if block + need > num_blocks:
                break
            sampling = internal_pb2.SamplingConfig()
            seqs.append((SeqState([0] * n, list(range(block, block + need)), 0, sampling), n))
            block, left = block + need, left - n
        if not seqs:
            return 0
        inputs = self.prepare_inputs(seqs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, kv_caches)
        self.model.compute_logits(hidden[inputs.logits_indices]).argmax(-1).tolist()
        return num_tokens - left

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak bytes of weights + activations of the largest batch (CUDA), the KV cache excluded,
        plus what CUDA itself holds outside torch's allocator (context, cuBLAS workspaces)."""
        tokens = self.args.max_num_batched_tokens
        num_blocks = -(-tokens // self.block_size) + -(-tokens // self.max_model_len)
        scratch = CacheEngine(self.config, num_blocks, 0, self.block_size, self.dtype, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_forward(tokens, scratch.kv_caches, num_blocks)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.device_cache.nbytes
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        del scratch
        torch.cuda.empty_cache()
        return peak + outside_torch

    @torch.inference_mode()
    def _measure_prefill(self) -> float:
        """Tokens per second of one prefill, after a small forward that pays one-time costs."""
        num_blocks = self.cache.num_blocks
        tokens = min(self.args.max_num_batched_tokens, 256 if self.device.type == "cpu" else 2048,
                     num_blocks * self.block_size)
        self._dummy_forward(min(16, tokens), self.cache.kv_caches, num_blocks)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        sync()
        start = time.perf_counter()
        done = self._dummy_forward(tokens, self.cache.kv_caches, num_blocks)
        sync()
        return done / max(time.perf_counter() - start, 1e-9)


def logprobs_message(slot: int, prompt: bool, first_position: int, token_ids: torch.Tensor,
                     lps, lo: int, hi: int, k: int) -> internal_pb2.Logprobs:
    """Rows lo:hi of compute_logprobs' output, with the top k of each, as a Logprobs message."""
    values, ranks, top_ids, top_values = (t[lo:hi].cpu() for t in lps)
    return internal_pb2.Logprobs(
        slot=slot, prompt=prompt, first_position=first_position,
        token_ids=pack(token_ids[lo:hi].cpu().numpy()), logprobs=pack_f32(values.float().numpy()),
        ranks=pack(ranks.numpy()), k=k, top_token_ids=pack(top_ids[:, :k].reshape(-1).numpy()),
        top_logprobs=pack_f32(top_values[:, :k].reshape(-1).float().numpy()))
