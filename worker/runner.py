"""ModelRunner: executes the scheduler's StepPlans against the model and the paged KV cache.

Start-up (load, size the cache, measure) is worker/startup/stages.py; each plan runs through the fixed
stages of worker/step/pipeline.py, with the features as its hooks (speculation, grammars, beam
search). The worker mirrors the scheduler's view of each sequence (tokens, blocks, computed
count) in its persistent batch (worker/step/input_batch.py), so that a plan only has to carry the
diff; see proto/internal.proto for the meaning of each field.
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from process_life.flag_errors import FlagError
from modelfiles.resolve import model_display_name, resolve_model
from proto import internal_pb2
from proto.auth import PROTOCOL_VERSION
from worker.step.beam import BeamHook
from worker.grammar.matchers import GrammarRows
from worker.grammar.hook import GrammarHook
from worker.step.input_batch import InputBatch, StepInputs
from worker.parallel.tensor_parallel import FORGET, PLAN, TensorParallel
from worker.step.plan_checks import check_compile, check_plan
from worker.startup.device import resolve_device, resolve_dtype
from worker.step.sampler import Sampler
from worker.speculation.hook import SpeculationHook
from worker.startup.stages import start_up
from worker.step.pipeline import StepPipeline, inputs_on
from worker.worker_flags import default_worker_id

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's runner. Under tensor parallelism (tp) every rank runs every plan; rank 0 hands
    each plan on to the others, and alone computes logits and samples (worker/parallel/tensor_parallel.py)."""

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
        start_up(self)  # config, model, speculator, cache and the measured rates

        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(args.seed))
        self.grammar = GrammarRows(self._grammar_cache)
        self.speculation = SpeculationHook(self.speculator, self.grammar, self.sampler)
        hooks = [self.speculation, BeamHook()]
        if self.tp.rank == 0:  # rank 0 alone samples
            hooks.insert(1, GrammarHook(self.grammar))
        self.step = StepPipeline(self.model, self.cache, self.sampler, self.tp, self.prepare_inputs,
                                 lambda: InputBatch(self.max_model_len, self.block_size), hooks)
        logger.info("worker %s ready: %s %s on %s, %d blocks of %d (+%d cpu), load %.1fs, prefill %.0f tok/s",
                    self.worker_id, self.config.architecture, self.dtype, self.device, self.cache.num_blocks,
                    self.block_size, self.cache.num_cpu_blocks, self.load_seconds, self.prefill_tokens_per_s)

    @property
    def batch(self) -> InputBatch:
        return self.step.batch

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
        self.step.forget()

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
        back until grammars_finished() says they are ready (worker/grammar/matchers.py)."""
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
                self.step.run(plan, result)
        except Exception as e:  # the process must outlive a bad plan; the scheduler aborts the step
            logger.exception("step %d failed", plan.step_id)
            result.slots = result.token_ids = b""
            del result.logprobs[:]
            result.error = f"{type(e).__name__}: {e}"
        result.forward_seconds = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------ one step's inputs

    def prepare_inputs(self, slots: np.ndarray, counts: np.ndarray,
                       batch: InputBatch | None = None, starts: np.ndarray | None = None) -> StepInputs:
        """Rows slots[i] compute counts[i] tokens (InputBatch.prepare), on the model's device; the
        step's batch unless another is given (start-up's dummy steps, a draft model's)."""
        return inputs_on(self.device, (batch or self.batch).prepare(slots, counts, starts))

    def _grammar_cache(self):
        from structured.compiler import GrammarCache, tokenizer_info
        from modelfiles.resolve import tokenizer_json
        info = tokenizer_info(tokenizer_json(self.model_path), self.config.vocab_size,
                              self.eos_token_ids or [0])
        return GrammarCache(info)
