"""The fake worker (tests/fake_worker.py) as a real process: worker.main's loop and socket around a
FakeWorker instead of the model, so tests can kill, stop and poison a worker in milliseconds.

    python -m launch --worker-module tests.fake_worker_main [flags]

    python -m tests.fake_worker_main --scheduler-worker-address ... [--step-delay S]

It takes the worker's flags (the launcher routes them), using --num-gpu-blocks-override,
--block-size, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --worker-id, the
address and the CURVE keys, bounds its socket as the real worker does (worker.main.bound_socket:
ZMQ_MAXMSGSIZE from the largest valid plan, the high-water marks), and runs the real worker's
loop and heartbeat thread. --step-delay, or PAGODA_FAKE_STEP_S under the launcher (whose
flags are the real worker's), makes each step take that many seconds, as a forward would, so
that streams last long enough to be disturbed. --hang-on-mark S makes the first step that
computes a HANG_MARK prompt (tests/fake_worker.py) take S more seconds ("inf": forever) while
the heartbeat thread beats on; a worker hangs once per process. --die-on-mark makes the step
that computes a DIE_MARK prompt end the process at once (exit status 1), heartbeats and all.

Grammars (structured outputs) are not compiled, but answered as the real worker answers: each
is ready --grammar-compile-delay seconds after it was asked for, or fails (the compiler's
refusal) when its text holds GRAMMAR_FAILS. The fake's tokens ignore them.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import zmq

from proto import internal_pb2 as pb
from tests.fake_worker import DIE_MARK, FakeWorker, hangs
from worker.heartbeat import heartbeats, main_routing_id
from worker.main import Link, main_socket, serve
from worker.speculation.config import SpeculativeConfig
from worker.worker_flags import add_worker_args, default_worker_id


GRAMMAR_FAILS = "fake-worker: does not compile"


class FakeRunner:
    def __init__(self, args) -> None:
        self.compile_s = args.grammar_compile_delay
        self._compiling: dict[str, tuple[float, str]] = {}  # key -> (when done, spec text)
        self.worker_id = args.worker_id or default_worker_id()
        # --speculative-config as the real worker takes it; the fake proposes (tests/fake_worker.py).
        spec = SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None
        self.fake = FakeWorker(args.num_gpu_blocks_override or 256, args.block_size, self.worker_id,
                               num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                               disable_by_batch_size=spec.disable_by_batch_size if spec else 0)
        self.max_model_len = args.max_model_len or 4096
        self.max_num_seqs, self.max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
        self.step_s = args.step_delay
        self.hang_s = args.hang_on_mark  # None: HANG_MARK is a plain token here
        self.die = args.die_on_mark

    def hello(self) -> pb.WorkerHello:
        hello = self.fake.hello(self.max_model_len)
        # The plan bounds it reports, as the real worker does: they size its socket's limit.
        hello.max_num_seqs, hello.max_num_batched_tokens = self.max_num_seqs, self.max_num_batched_tokens
        return hello

    def forget_all(self) -> None:
        self.fake.forget_all()

    def warm_grammars(self) -> None:  # no vocabulary to load
        pass

    def compile_grammars(self, msg: pb.CompileGrammars) -> None:
        for g in msg.grammars:
            self._compiling.setdefault(g.key, (time.monotonic() + self.compile_s, str(g.structured_output)))

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def grammars_finished(self) -> pb.GrammarsCompiled | None:
        now = time.monotonic()
        done = [(key, text) for key, (at, text) in self._compiling.items() if at <= now]
        if not done:
            return None
        msg = pb.GrammarsCompiled()
        for key, text in done:
            del self._compiling[key]
            if GRAMMAR_FAILS in text:
                msg.failed.add(key=key, reason="the fake worker refuses it")
            else:
                msg.ready.append(key)
        return msg

    def execute(self, plan: pb.StepPlan) -> pb.StepResult:
        start = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)
        if self.hang_s is not None and hangs(plan, self.fake.seqs):
            logging.warning("hanging step %d for %g s", plan.step_id, self.hang_s)
            threading.Event().wait(None if self.hang_s == float("inf") else self.hang_s)
            self.hang_s = None
        if self.die and hangs(plan, self.fake.seqs, DIE_MARK):
            logging.warning("dying in step %d", plan.step_id)
            os._exit(1)
        result = self.fake.execute(plan)
        result.forward_seconds = time.perf_counter() - start
        return result


def main(argv: list[str] | None = None) -> int:
    parser = add_worker_args(argparse.ArgumentParser("fake worker"))
    parser.add_argument("--step-delay", type=float,
                        default=float(os.environ.get("PAGODA_FAKE_STEP_S", "0")))
    parser.add_argument("--hang-on-mark", type=float, default=None)
    parser.add_argument("--die-on-mark", action="store_true")
    parser.add_argument("--grammar-compile-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # serve() takes over once it runs
    runner = FakeRunner(args)
    ctx = zmq.Context()
    routing_id = main_routing_id(runner.worker_id)
    # Bounded (ZMQ_MAXMSGSIZE, HWMs), authenticated and rebuilt as the real worker's.
    link = Link(main_socket(ctx, args, runner.hello(), routing_id))
    try:
        with heartbeats(ctx, args.scheduler_worker_address, routing_id, hwm=args.zmq_hwm,
                        keys_dir=args.zmq_keys_dir):
            return serve(runner, link)
    finally:
        link.finish()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
