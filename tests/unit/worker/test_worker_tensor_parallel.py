"""--tensor-parallel-size: one worker as N real rank processes over gloo, against one process.

Rank 0 runs tests/tp_driver.py (PlanDriver's plans instead of a scheduler), or worker.main
against a ROUTER socket playing the scheduler; ranks 1..N-1 are the real worker.main followers
either way. The reference is the same model in one process (TP=1), which
tests/unit/worker/test_model_parity.py compares with transformers.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from proto import internal_pb2
from proto.columns import unpack_list
from tests.cluster import wait_for
from tests.plan_driver import PlanDriver
from tests.unit.worker.test_model_parity import SMOLLM2_PROMPTS, TINY_PROMPTS
from tests.unit.worker.test_worker_main import receive, scheduler_socket, send  # noqa: F401 (a fixture)
from tests.worker_tiny_models import make_hf_model, runner_args, save_model
from worker.model.config import ModelConfig
from worker.parallel.tensor_parallel import refusal
from worker.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[3]
# Fewer than test_model_parity's: a gloo all-reduce per layer makes each step slow on two cores,
# and the logits are compared at every step.
NEW_TOKENS = 16
WORKER_FLAGS = ["--dtype", "float32", "--device", "cpu", "--max-num-batched-tokens", "64",
                "--insecure"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # q/k/v and o_proj biases and tied embeddings: a bias split by rows, one added after the
    # all-reduce, and the replicated embedding doubling as the LM head.
    return save_model(make_hf_model("llama3-tied-bias", seed=1), tmp_path_factory.mktemp("tp-tiny"))


def generate_tp(tmp_path: Path, model: str, size: int, prompts, num_blocks: int = 64) -> dict:
    """Greedy tokens and logits [prompts, NEW_TOKENS, vocab] from a worker of `size` ranks."""
    out = tmp_path / f"tp{size}.npz"
    flags = ["--model", model, "--tensor-parallel-size", str(size),
             "--num-gpu-blocks-override", str(num_blocks), *WORKER_FLAGS]
    proc = subprocess.run([sys.executable, "-m", "tests.tp_driver", str(out), json.dumps(prompts),
                           str(NEW_TOKENS), "--", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(np.load(out))


def generate_one_process(runner: ModelRunner, prompts) -> tuple[list[list[int]], np.ndarray]:
    seqs = PlanDriver(runner).generate(prompts, NEW_TOKENS)
    return [s.output for s in seqs], np.stack([torch.stack(s.logits).numpy() for s in seqs])


def assert_same_generation(tp: dict, tokens, logits) -> None:
    assert tp["tokens"].tolist() == tokens
    assert tp["tokens"].shape == (4, NEW_TOKENS)
    gap = float(np.abs(tp["logits"] - logits).max())
    print(f"largest logit difference from one process: {gap:.2e}")
    assert gap <= 1e-4


def test_tiny_model_on_two_ranks_generates_as_one_process(tiny_model, tmp_path):
    tp = generate_tp(tmp_path, str(tiny_model), 2, TINY_PROMPTS)
    runner = ModelRunner(runner_args(tiny_model))
    assert int(tp["kv_heads"]) == 1 and runner.cache.device_cache.shape[4] == 2  # its half each
    assert int(tp["num_blocks"]) == 64  # one pool: block i is on every rank
    assert_same_generation(tp, *generate_one_process(runner, TINY_PROMPTS))


def test_sizes_that_do_not_split_the_heads_are_refused_naming_the_flag():
    smollm2 = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    assert refusal(smollm2, 3) is None and refusal(smollm2, 1) is None
    assert refusal(smollm2, 2) == (
        "--tensor-parallel-size 2 does not divide the model's 9 query heads and 3 KV heads: every "
        "rank must hold whole heads and an equal share of the MLP; sizes that work: 1, 3")
    assert refusal(smollm2, 0) == "--tensor-parallel-size must be at least 1, got 0"


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_tp_worker(model: Path, address: str, size: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "worker.main", "--model", str(model), "--tensor-parallel-size",
           str(size), "--num-gpu-blocks-override", "16", "--scheduler-worker-address", address,
           "--worker-id", "tp-worker", *WORKER_FLAGS]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_one_plan(sock) -> bytes:
    ident, msg = receive(sock)
    assert msg.hello.worker_id == "tp-worker" and msg.hello.num_blocks == 16
    assert msg.hello.device == "cpu x 2 ranks"
    plan = internal_pb2.StepPlan(step_id=1, new_seqs=[internal_pb2.NewSeq(
        seq_id="r1", slot=0, token_ids=[1, 2, 3, 4, 5], block_ids=[3], num_new_tokens=5)])
    send(sock, ident, plan=plan)
    _, msg = receive(sock)
    assert unpack_list(msg.result.slots) == [0] and not msg.result.error
    return ident


@contextlib.contextmanager
def two_rank_worker(model: Path, sock, address: str):
    """A 2-rank worker that has run one plan: yields (process, rank 1's pid, its output once it
    exits). The process is killed if the test leaves it running."""
    proc = start_tp_worker(model, address, 2)
    output: list[str] = []
    try:
        run_one_plan(sock)
        [rank1] = children(proc.pid)
        yield proc, rank1, output
    finally:
        if proc.poll() is None:
            proc.kill()
        output.append(proc.communicate()[0])


def test_a_killed_rank_takes_its_worker_down_with_a_goodbye(tiny_model, scheduler_socket):  # noqa: F811
    sock, address = scheduler_socket
    with two_rank_worker(tiny_model, sock, address) as (proc, rank1, output):
        killed_at = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        _, msg = receive(sock, timeout_s=10)
        noticed = time.monotonic() - killed_at
        print(f"rank 1 killed: goodbye after {noticed:.2f} s")
        assert msg.WhichOneof("kind") == "goodbye"
        assert noticed < 2.0  # checked between steps (0.2 s), not after the scheduler's timeout
        assert proc.wait(timeout=30) == 1
    assert "a tensor-parallel rank is lost (rank 1" in output[0], output[0]


def test_sigterm_stops_every_rank_after_a_goodbye(tiny_model, scheduler_socket):  # noqa: F811
    sock, address = scheduler_socket
    with two_rank_worker(tiny_model, sock, address) as (proc, rank1, output):
        proc.send_signal(signal.SIGTERM)
        _, msg = receive(sock, timeout_s=10)
        assert msg.WhichOneof("kind") == "goodbye"
        assert proc.wait(timeout=30) == 0
        assert wait_for(lambda: not alive(rank1), 10)
    assert "Traceback" not in output[0], output[0]


@pytest.mark.integration
def test_smollm2_on_three_ranks_generates_as_one_process(tmp_path):
    tp = generate_tp(tmp_path, "", 3, SMOLLM2_PROMPTS)
    assert int(tp["kv_heads"]) == 1  # SmolLM2's 3 KV heads, one per rank
    runner = ModelRunner(runner_args("", num_blocks=64))
    assert_same_generation(tp, *generate_one_process(runner, SMOLLM2_PROMPTS))


@pytest.mark.integration
def test_smollm2_refuses_two_ranks_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "worker.main", "--tensor-parallel-size", "2",
                           "--insecure"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "--tensor-parallel-size 2 does not divide the model's 9 query heads and 3 KV heads: every "
        "rank must hold whole heads and an equal share of the MLP; sizes that work: 1, 3")
    assert "Traceback" not in proc.stderr
