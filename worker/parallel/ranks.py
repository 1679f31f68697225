"""The processes of one tensor-parallel worker: rank 0 is the process the launcher started; it
starts ranks 1..N-1 as `python -m worker.main` with the same flags, serves them a TCPStore on a
free loopback port to meet through, and watches them.

A worker is whole or gone. A rank that dies breaks the next collective at once (its connections
close), and rank 0 checks its children between steps too; either way rank 0 says goodbye to the
scheduler, which recomputes the worker's sequences elsewhere, ends the other ranks and exits 1
(the launcher starts the worker again). Ranks 1..N-1 die with rank 0 (PR_SET_PDEATHSIG), and
exit by themselves when a collective with it fails.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch

from process_life import lifetime
from proto import internal_pb2
from worker.parallel.tensor_parallel import (COLLECTIVE_TIMEOUT_S, FLAG, FORGET, KEEPALIVE, PLAN, STOP, GroupLost,
                             TensorParallel, init_group, refusal)

logger = logging.getLogger("pagoda.worker")

ROOT = Path(__file__).resolve().parents[2]
# Set by rank 0 for the ranks it starts: which rank, where its store is, and its own pid.
RANK_ENV, PORT_ENV, PARENT_ENV = "PAGODA_TP_RANK", "PAGODA_TP_PORT", "PAGODA_TP_PARENT"
STOP_WAIT_S = 5.0


def is_follower() -> bool:
    return RANK_ENV in os.environ


class RankGroup:
    """Rank 0's view of the ranks it started."""

    def __init__(self, tp: TensorParallel, children: list[subprocess.Popen]) -> None:
        self.tp = tp
        self.children = children

    def lost(self) -> str | None:
        """Why the group is broken (a rank has exited), or None."""
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                return f"rank {rank} (pid {child.pid}) exited with {child.returncode}"
        return None

    def keepalive(self) -> None:
        self.tp.send(KEEPALIVE)

    def stop(self, graceful: bool) -> None:
        """Ends ranks 1..N-1: by a STOP message when the group is whole and idle, else by
        SIGTERM; SIGKILL for any still there after STOP_WAIT_S."""
        if graceful and self.lost() is None:
            try:
                self.tp.send(STOP)
            except GroupLost:
                pass
        else:
            for child in self.children:
                if child.poll() is None:
                    child.terminate()
        for child in self.children:
            try:
                child.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        torch.distributed.destroy_process_group()


def _cpu_threads(size: int) -> None:
    # N ranks on one host share its cores; more threads than cores only makes them wait.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def start_group(args: argparse.Namespace, argv: list[str], device: torch.device) -> RankGroup:
    """Rank 0: refuses a size that does not split the model, starts the other ranks with the
    worker's own flags, and joins them."""
    from modelfiles.resolve import resolve_model
    from worker.model.config import ModelConfig

    size = args.tensor_parallel_size
    if why := refusal(ModelConfig.read(resolve_model(args.model)), size):
        raise SystemExit(why)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise SystemExit(f"{FLAG} {size}: only {torch.cuda.device_count()} CUDA devices are visible")
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = torch.distributed.TCPStore("127.0.0.1", 0, size, True, timeout=timeout,
                                       wait_for_workers=False)
    children = []
    try:
        for rank in range(1, size):
            env = dict(os.environ, **{RANK_ENV: str(rank), PORT_ENV: str(store.port),
                                      PARENT_ENV: str(os.getpid())})
            children.append(subprocess.Popen([sys.executable, "-m", "worker.main", *argv], cwd=ROOT,
                                             env=env))
            logger.info("started tensor-parallel rank %d of %d (pid %d)", rank, size, children[-1].pid)
        if device.type == "cpu":
            _cpu_threads(size)
        return RankGroup(init_group(0, size, store, device), children)
    except BaseException:
        for child in children:
            child.kill()
        raise


def join_group(args: argparse.Namespace, device: torch.device) -> TensorParallel:
    """Ranks 1..N-1: join the group rank 0 started this process for."""
    # SIGKILL: a rank holds nothing worth a clean exit, and must not outlive rank 0 in a
    # collective that would wait COLLECTIVE_TIMEOUT_S for it. Set here, not in a preexec_fn,
    # so that rank 0 is vfork()ed (process_life/lifetime.py says why).
    lifetime.die_with_parent(signal.SIGKILL)
    if os.getppid() != int(os.environ[PARENT_ENV]):  # rank 0 died before PR_SET_PDEATHSIG held
        raise SystemExit("rank 0 of this worker is gone")
    # Stopped by rank 0 alone: a Ctrl-C meant for the terminal's foreground job must not take
    # a rank out from under a step; SIGTERM ends it at once, wherever it waits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank, size = int(os.environ[RANK_ENV]), args.tensor_parallel_size
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:
        _cpu_threads(size)
    store = torch.distributed.TCPStore("127.0.0.1", int(os.environ[PORT_ENV]), size, False,
                                       timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return init_group(rank, size, store, device)


def follow(runner, tp: TensorParallel) -> int:
    """Ranks 1..N-1: run what rank 0 sends until it says stop (0) or is gone (1)."""
    try:
        while True:
            kind, payload = tp.receive()
            if kind == PLAN:
                runner.execute(internal_pb2.StepPlan.FromString(payload))  # rank 0 answers
            elif kind == FORGET:
                runner.forget_all()
            elif kind == STOP:
                torch.distributed.destroy_process_group()
                return 0
    except GroupLost as e:
        logger.error("rank %d: lost rank 0 (%s); exiting", tp.rank, e)
        return 1
