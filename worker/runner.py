"""ModelRunner: executes the scheduler's StepPlans against the model and the paged KV cache.

The worker mirrors the scheduler's view of each sequence (tokens, blocks, computed count) in its
persistent batch (worker/input_batch.py), so that a plan only has to carry the diff; see
proto/internal.proto for the meaning of each field.
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from process_life.flag_errors import FlagError
from modelfiles.resolve import model_display_name, resolve_model
from proto import internal_pb2
from proto.auth import PROTOCOL_VERSION
from proto.columns import pack, unpack
from worker.attention_metadata import AttentionMetadata
from worker.attention_backends import select_backend
from worker.cache import CacheEngine, bytes_per_block, num_device_blocks
from worker.eos import eos_token_ids
from worker.grammar import GrammarRows, why_no_token
from worker.host_memory import keep_freed_memory
from worker.input_batch import InputBatch, StepInputs
from worker.layers import use_cpu_kernel, use_quantized_kernel
from worker.loader import load_weights
from worker.model import build_model, projection_shapes
from worker.parallel import FORGET, PLAN, TensorParallel, shard_config
from worker.plan_checks import check_compile, check_plan
from worker.device import resolve_device, resolve_dtype
from worker.sampler import Sampler, plain_greedy
from worker.speculative import build_speculator, result_columns
from worker.startup_measurements import (measure_attention_prefetch, measure_decode_step_bound, measure_prefill,
                                         profile_peak_memory)
from worker.step_logprobs import prompt_logprobs, sampled_logprobs
from worker.worker_flags import default_worker_id

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 2**30
MAX_DEFAULT_MODEL_LEN = 8192


class ModelRunner:
    """One rank's runner. Under tensor parallelism (tp) every rank runs every plan; rank 0 hands
    each plan on to the others, and alone computes logits and samples (worker/parallel.py)."""

    def __init__(self, args: argparse.Namespace, tp: TensorParallel | None = None) -> None:
        self.args = args
        self.tp = tp or TensorParallel()
        self.worker_id = args.worker_id or default_worker_id()
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device, quantized=bool(args.quantization))
        self.block_size = args.block_size
        try:
            self.model_path = resolve_model(args.model)
        except FileNotFoundError as e:
            raise FlagError(str(e)) from None

        # A progress bar where a person watches (a terminal); the log lines below say the same.
        progress = tqdm(total=5, desc=f"worker {self.worker_id}", unit="stage", disable=None,
                        bar_format="{desc}: {n}/{total} {postfix} [{elapsed}]")
        stage = progress.set_postfix_str
        stage("loading weights")
        start = time.perf_counter()
        self.config, weights = load_weights(self.model_path)
        progress.update()
        stage("building the model")
        trained_len = self.config.max_position_embeddings
        self.max_model_len = args.max_model_len or min(trained_len, MAX_DEFAULT_MODEL_LEN)
        if why := self.config.context_refusal(args.max_model_len, args.allow_long_max_model_len):
            raise FlagError(why)
        if self.max_model_len > trained_len:
            logger.warning("--max-model-len %d is beyond the %d positions the model was trained on "
                           "(--allow-long-max-model-len)", self.max_model_len, trained_len)
        self.backend = select_backend(args.attention_backend, self.device.type)
        # This rank's share of the heads and MLP (all of them without a group).
        shard = shard_config(self.config, self.tp.size)
        if self.device.type == "cpu":
            keep_freed_memory()
            use_cpu_kernel(args.cpu_matmul == "auto", (shard.intermediate_size, shard.hidden_size), self.dtype,
                           args.measure_again)
            if args.quantization:
                use_quantized_kernel(args.cpu_matmul == "auto", projection_shapes(shard),
                                     args.quantization, args.measure_again,
                                     vocab_shape=(self.config.vocab_size, shard.hidden_size))
        self.model = build_model(shard, weights, self.backend, self.max_model_len, self.device,
                                 self.dtype, self.tp,
                                 # a quantized model builds its own (LlamaForCausalLM.quantize_gguf)
                                 fused_decode=args.cpu_matmul == "auto" and not args.quantization)
        del weights
        if args.quantization:
            if self.device.type != "cpu" or self.dtype != torch.float32 or self.tp.size != 1:
                raise FlagError(f"--quantization {args.quantization} runs on the CPU, with --dtype "
                                 "float32, on one rank")
            logger.info("%s weights: %.0f MB", args.quantization,
                        self.model.quantize(args.quantization, self.model_path) / 1e6)
        progress.update()
        self.load_seconds = time.perf_counter() - start
        self.eos_token_ids = eos_token_ids(self.model_path, self.config.eos_token_ids)
        if not self.eos_token_ids:
            logger.warning("%s names no end-of-sequence token: answers end only at max_tokens, "
                           "a stop id or a stop string", self.model_path)

        self.speculator = build_speculator(getattr(args, "speculative_config", None), self)
        stage("sizing the KV cache")
        # A draft model's cache has a block for each of the target's, in the same budget.
        block_bytes = bytes_per_block(shard, self.block_size, self.dtype) + (
            self.speculator.draft_bytes_per_block(self.block_size) if self.speculator else 0)
        peak = profile_peak_memory(self) if self.device.type == "cuda" else 0
        num_blocks = num_device_blocks(
            override=args.num_gpu_blocks_override, device=self.device, block_bytes=block_bytes,
            kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES,
            gpu_memory_utilization=args.gpu_memory_utilization, profiled_peak_bytes=peak)
        # One block pool for the whole group: block i exists on every rank (each with its heads).
        num_blocks = self.tp.min_over_ranks(num_blocks)
        num_cpu_blocks = int(args.swap_space * 2**30) // block_bytes
        self.cache = CacheEngine(shard, num_blocks, num_cpu_blocks, self.block_size, self.dtype,
                                 self.device)
        if self.speculator:
            self.speculator.allocate_draft_cache(num_blocks, self.block_size)
        progress.update()
        stage("measuring swap bandwidth")
        self.swap_bytes_per_s = self.cache.measure_swap_bandwidth()
        progress.update()
        stage("warming up (one prefill)")
        self.prefill_tokens_per_s = measure_prefill(self)
        measure_attention_prefetch(self)
        measure_decode_step_bound(self)
        progress.update()
        progress.close()

        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(args.seed))
        self.batch = InputBatch(self.max_model_len, self.block_size)
        self.grammar = GrammarRows(self._grammar_cache)
        logger.info("worker %s ready: %s %s on %s, %d blocks of %d (+%d cpu), load %.1fs, prefill %.0f tok/s",
                    self.worker_id, self.config.architecture, self.dtype, self.device, num_blocks,
                    self.block_size, num_cpu_blocks, self.load_seconds, self.prefill_tokens_per_s)

    # ------------------------------------------------------------------ the contract

    def hello(self) -> internal_pb2.WorkerHello:
        device = str(self.device)
        if self.device.type == "cuda":
            device += f" ({torch.cuda.get_device_name(self.device)})"
        if self.tp.size > 1:
            device += f" x {self.tp.size} ranks"
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
            max_num_seqs=self.args.max_num_seqs,
            protocol_version=PROTOCOL_VERSION,
            **(self.speculator.hello_fields() if self.speculator else {}),
        )

    def forget_all(self) -> None:
        """Drop every sequence held (a new scheduler knows none of them)."""
        if self.tp.rank == 0:
            self.tp.send(FORGET)
        self.batch = InputBatch(self.max_model_len, self.block_size)
        self.grammar.drop(list(self.grammar.matchers) + list(self.grammar.failed))

    def warm_grammars(self) -> None:
        """Loads the vocabulary for structured outputs now (0.8 s for SmolLM2 on a Zen 2 EPYC),
        before the worker says hello: in the background after it, the load took the CPU from the
        first request's prefill. A load that fails is logged; the first compile tries again and
        reports its error with the request."""
        try:
            self.grammar.warm().result()
        except Exception as e:  # noqa: BLE001 (xgrammar's errors have no common base)
            logger.warning("the vocabulary for structured outputs did not load: %s", e)

    def compile_grammars(self, msg: internal_pb2.CompileGrammars) -> None:
        """Start compiling, in the background, the grammars of sequences the scheduler holds
        back until grammars_finished() says they are ready (worker/grammar.py)."""
        if why := check_compile(msg):
            logger.error("refused a grammar request: %s", why)
            return
        self.grammar.compile(msg.grammars)

    def grammars_finished(self) -> internal_pb2.GrammarsCompiled | None:
        return self.grammar.finished()

    @property
    def compiling(self) -> bool:
        return self.grammar.compiling

    def execute(self, plan: internal_pb2.StepPlan) -> internal_pb2.StepResult:
        result = internal_pb2.StepResult(step_id=plan.step_id)
        start = time.perf_counter()
        if self.tp.rank == 0 and self.tp.size > 1:  # every rank runs the plan, checks included
            self.tp.send(PLAN, plan.SerializeToString())
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
        batch = self.batch
        batch.drop(plan.dropped_slots)
        self.grammar.drop(plan.dropped_slots)
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy(plan.copy)
        for new in plan.new_seqs:
            sampling = internal_pb2.SamplingConfig()
            sampling.CopyFrom(new.sampling)
            batch.add(new.slot, new.token_ids, new.block_ids, new.num_computed_tokens,
                      new.num_prompt_tokens, sampling)
            if self.tp.rank == 0:  # rank 0 alone samples
                self.grammar.add(new.slot, sampling, new.token_ids[new.num_prompt_tokens:])
        batch.append_blocks(unpack(plan.new_block_slots).astype(np.int64),
                            unpack(plan.new_block_ids))
        next_slots = unpack(plan.next_token_slots).astype(np.int64)
        batch.check_held(next_slots)
        batch.append_tokens(next_slots, unpack(plan.next_token_ids))  # beam search's choices
        running = unpack(plan.running_slots).astype(np.int64)
        batch.check_held(running)
        # Plan order: new sequences first, then the held ones; the result follows it.
        slots = np.concatenate([np.fromiter((n.slot for n in plan.new_seqs), np.int64,
                                            len(plan.new_seqs)), running])
        counts = np.concatenate([np.fromiter((n.num_new_tokens for n in plan.new_seqs), np.int64,
                                             len(plan.new_seqs)),
                                 unpack(plan.running_num_tokens).astype(np.int64)])
        if len(slots) != len(counts) or len(np.unique(slots)) != len(slots):
            raise ValueError("a plan names a slot twice, or slots and counts differ in number")
        work = counts > 0
        slots, counts = slots[work], counts[work]
        if not len(slots):
            return

        spec = runs = None
        if plan.spec_slots:
            if self.speculator is None:
                raise ValueError("a plan speculates on a worker started without --speculative-config")
            spec = self.speculator.propose(batch, plan.spec_slots, plan.spec_num_tokens, slots, counts)
        try:
            inputs = self.prepare_inputs(slots, counts)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.cache.kv_caches)
            sampled_slots = inputs.sampled_slots
            if self.tp.rank == 0:
                try:
                    tokens, runs = self._sample(slots, counts, hidden, inputs, result, spec)
                except Exception:
                    self.tp.send_tokens(None)  # the other ranks fail the step too
                    raise
                self.tp.send_tokens(np.concatenate([tokens, spec.accepted]) if spec else tokens)
            else:
                tokens = self.tp.receive_tokens(len(sampled_slots) + (len(spec.rows) if spec else 0))
                if spec:
                    tokens, spec.accepted = tokens[:len(sampled_slots)], tokens[len(sampled_slots):].tolist()
        except Exception:
            if spec:
                self.speculator.undo(batch, slots, spec)
            raise
        batch.advance(slots, counts)
        if spec:
            self.speculator.settle(batch, slots, spec)
        if (tokens < 0).any():  # failed rows (result.failed) keep no token
            sampled_slots, tokens = sampled_slots[tokens >= 0], tokens[tokens >= 0]
        beam = batch.beam[sampled_slots]
        if not beam.any():
            batch.append_tokens(sampled_slots, tokens)
        else:  # a beam's next token is the scheduler's choice, named in a later plan
            batch.append_tokens(sampled_slots[~beam], tokens[~beam])
        if self.tp.rank == 0:
            self.grammar.accept(sampled_slots, tokens)
        if spec and spec.rows and self.tp.rank == 0:
            result_columns(result, sampled_slots, tokens, slots, spec, runs)
            return
        result.slots = pack(sampled_slots)
        result.token_ids = pack(tokens)

    def _sample(self, slots, counts, hidden, inputs: StepInputs, result, spec):
        """Prompt logprobs, then the next token of each sampling row and its logprobs, and the
        runs of tokens of the rows that speculated (worker/speculative.py)."""
        batch = self.batch
        prompt_logprobs(batch, self.model.compute_logits, slots, counts, hidden, result)
        sampled_slots = inputs.sampled_slots
        if not len(sampled_slots):
            return np.zeros(0, np.int64), None
        idx, speculated = inputs.logits_indices, spec is not None and bool(spec.rows)
        slot_list = sampled_slots.tolist()
        params = [batch.sampling[s] for s in slot_list]
        rows = self.grammar.constrained(slot_list)
        if not speculated and not rows and not self.grammar.failed and all(map(plain_greedy, params)):
            # The max of each row's logits, the LM head and the max in one pass where a kernel
            # does both (None: not here)
            tokens = self.model.greedy_tokens(hidden[idx])
            if tokens is not None:
                return tokens.numpy(), None
        if speculated:  # the proposals' positions too, in the same pass over the LM head
            idx = torch.cat([idx, self.speculator.draft_logits_indices(spec, counts).to(idx.device)])
        logits = self.model.compute_logits(hidden[idx])
        logits, draft_logits = logits[:len(sampled_slots)], logits[len(sampled_slots):]
        history = [batch.tokens(s) for s in slot_list]
        allowed = (rows, self.grammar.mask(slot_list, rows, logits.shape[1])) if rows else None
        sampled = self.sampler(logits, params, inputs.sample_positions, history,
                               batch.num_prompt[sampled_slots].tolist(), allowed)
        runs, skip = None, ()
        if speculated:  # their runs, with the runs' logprobs
            runs, skip = self.speculator.verify_rows(
                spec, batch, self.grammar, slots, sampled_slots, params, history, draft_logits,
                logits, sampled, self.sampler.generator, result)
        self._fail_rows(slot_list, rows, params, history, sampled, result)
        sampled_logprobs(sampled_slots, params, logits, sampled, inputs.sample_positions, result, skip)
        return sampled.cpu().numpy(), runs

    def _fail_rows(self, slots, rows, params, history, sampled, result) -> None:
        """Rows whose grammar left them no token (only constrained rows can be), or that have no
        matcher to go on with, end (result.failed) instead of sampling: their token becomes -1.
        A batch without grammars pays nothing here."""
        failed = self.grammar.failed
        if not rows and not failed:
            return
        dead = torch.nonzero(sampled < 0).flatten().tolist() if rows else []
        stuck = [i for i, s in enumerate(slots) if s in failed] if failed else []
        for i in sorted({*dead, *stuck}):
            slot = slots[i]
            why = failed.get(slot) or why_no_token(
                params[i], len(history[i]) - int(self.batch.num_prompt[slot]))
            sampled[i] = -1
            result.failed.append(internal_pb2.SeqFailure(slot=slot, reason=why))

    def prepare_inputs(self, slots: np.ndarray, counts: np.ndarray,
                       batch: InputBatch | None = None, starts: np.ndarray | None = None) -> StepInputs:
        inputs = (batch or self.batch).prepare(slots, counts, starts)
        if self.device.type == "cpu":
            return inputs
        to = self._to_device
        m = inputs.meta
        meta = AttentionMetadata(to(m.slot_mapping), to(m.block_tables), to(m.seq_lens),
                                 to(m.query_start_loc), m.max_seq_len, m.max_query_len)
        return StepInputs(to(inputs.input_ids), to(inputs.positions), meta,
                          to(inputs.logits_indices), inputs.sampled_slots, inputs.sample_positions)

    def _grammar_cache(self):
        from structured.compiler import GrammarCache, tokenizer_info
        from modelfiles.resolve import tokenizer_json
        info = tokenizer_info(tokenizer_json(self.model_path), self.config.vocab_size,
                              self.eos_token_ids or [0])
        return GrammarCache(info)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)
