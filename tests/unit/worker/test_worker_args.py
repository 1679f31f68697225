"""worker.worker_flags: the flag contract with the launcher, sizes, and what auto means."""
from __future__ import annotations

import argparse

import pytest
import torch

from worker.startup import device
from worker.startup.device import resolve_device, resolve_dtype
from worker.worker_flags import add_worker_args, parse_bytes, worker_args


@pytest.mark.parametrize("text,expected", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 1_500_000_000),
                                           ("1000", 1000), ("4 kib", 4096)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_defaults():
    a = worker_args()
    assert (a.model, a.dtype, a.device, a.block_size, a.max_model_len) == ("", "auto", "auto", 16, None)
    assert (a.num_gpu_blocks_override, a.kv_cache_memory, a.gpu_memory_utilization) == (None, None, 0.9)
    assert (a.swap_space, a.seed, a.attention_backend, a.max_num_batched_tokens) == (0.0, 0, "auto", 2048)
    assert a.scheduler_worker_address == "tcp://127.0.0.1:5556" and a.worker_id is None
    assert a.measure_again is False and worker_args(["--measure-again"]).measure_again is True
    assert worker_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 << 30


def test_flag_names_are_the_contract():
    parser = add_worker_args(argparse.ArgumentParser())
    flags = {f for f in parser._option_string_actions if f.startswith("--")} - {"--help"}
    assert flags == {"--model", "--dtype", "--device", "--block-size", "--max-model-len",
                     "--allow-long-max-model-len", "--num-gpu-blocks-override", "--kv-cache-memory", "--gpu-memory-utilization",
                     "--swap-space", "--seed", "--attention-backend", "--cpu-matmul", "--cpu-decode-step-tokens",
                     "--measure-again",
                     "--max-num-batched-tokens", "--quantization",
                     "--scheduler-worker-address", "--worker-id", "--max-message-bytes", "--max-num-seqs",
                     "--log-level", "--tensor-parallel-size", "--busy-poll-us", "--zmq-hwm",
                     "--zmq-keys-dir", "--insecure", "--speculative-config"}


def test_quantization_formats(capsys):
    assert worker_args().quantization is None
    for kind in ("int8", "q8_0", "q4_1"):
        assert worker_args(["--quantization", kind]).quantization == kind
    with pytest.raises(SystemExit):
        worker_args(["--quantization", "q4_0"])
    err = capsys.readouterr().err  # how argparse quotes the choices varies by Python version
    assert "invalid choice: 'q4_0'" in err and all(kind in err for kind in ("int8", "q8_0", "q4_1"))


@pytest.mark.parametrize("flags, dtype", [
    ({"avx2", "fma"}, torch.float32),
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
], ids=["avx2", "avx512", "avx512_bf16", "amx"])
def test_auto_dtype_on_a_cpu_is_bf16_where_it_has_bf16_instructions(monkeypatch, flags, dtype):
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", torch.device("cpu")) == dtype


def test_auto_dtype_with_quantized_weights_is_fp32_their_activations_dtype(monkeypatch):
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert resolve_dtype("auto", torch.device("cpu"), quantized=True) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), quantized=True) == torch.bfloat16  # the runner refuses it


def test_this_cpus_flags_are_read_from_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        first = next(line for line in f if line.startswith("flags"))
    assert device.cpu_flags() == frozenset(first.split(":", 1)[1].split())
    assert "sse2" in device.cpu_flags()  # every x86-64 CPU


def test_auto_device_and_dtype():
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert resolve_dtype("float32", cpu) == torch.float32 and resolve_dtype("bfloat16", cpu) == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(RuntimeError):
            resolve_device("cuda")


@pytest.mark.parametrize("value", ["-1", "65", "x", "2.5"])
def test_a_decode_step_bound_out_of_range_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        worker_args(["--cpu-decode-step-tokens", value])
    err = capsys.readouterr().err
    assert "--cpu-decode-step-tokens" in err and "[0, 64]" in err


def test_a_decode_step_bound_in_range_is_taken():
    assert worker_args(["--cpu-decode-step-tokens", "0"]).cpu_decode_step_tokens == 0
    assert worker_args(["--cpu-decode-step-tokens", "64"]).cpu_decode_step_tokens == 64
    assert worker_args([]).cpu_decode_step_tokens is None
