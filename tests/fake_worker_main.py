"""The fake worker (tests/fake_worker.py) as a real process: worker.main's loop and socket around a
FakeWorker instead of the model, so tests can kill, stop and poison a worker in milliseconds.

    python -m launch --worker-module tests.fake_worker_main [flags]

It takes the worker's flags (the launcher routes them), using --num-gpu-blocks-override,
--block-size, --max-model-len, --worker-id and the address. PAGODA_FAKE_STEP_S (seconds) slows
each step down, so that streams last long enough to be disturbed.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import zmq

from proto import internal_pb2 as pb
from tests.fake_worker import FakeWorker
from worker.args import add_worker_args, default_worker_id
from worker.main import serve


class FakeRunner:
    def __init__(self, args) -> None:
        self.worker_id = args.worker_id or default_worker_id()
        self.fake = FakeWorker(args.num_gpu_blocks_override or 256, args.block_size, self.worker_id)
        self.max_model_len = args.max_model_len or 4096
        self.step_s = float(os.environ.get("PAGODA_FAKE_STEP_S", "0"))

    def hello(self) -> pb.WorkerHello:
        return self.fake.hello(self.max_model_len)

    def forget_all(self) -> None:
        self.fake.forget_all()

    def execute(self, plan: pb.StepPlan) -> pb.StepResult:
        start = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)
        result = self.fake.execute(plan)
        result.forward_seconds = time.perf_counter() - start
        return result


def main(argv: list[str] | None = None) -> int:
    args = add_worker_args(argparse.ArgumentParser("fake worker")).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # serve() takes over once it runs
    runner = FakeRunner(args)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(args.scheduler_worker_address)
        return serve(runner, sock)
    finally:
        sock.close(linger=1000)  # lets a goodbye leave
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
