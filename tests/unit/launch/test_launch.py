"""The launcher hands each flag to every process whose parser knows it."""
from __future__ import annotations

import json

import pytest

from process_life.flag_errors import FlagError
from launch.flag_routing import process_parsers, route_flags


def test_flags_reach_their_owners_and_parse():
    parsers = process_parsers()
    argv = ["--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--max-num-batched-tokens=512",
            "--scheduler-worker-address", "tcp://127.0.0.1:7000", "--model", "m.gguf", "--port", "6000",
            "--no-enable-prefix-caching", "--dtype", "float32"]
    routed = route_flags(argv, parsers)
    sched = parsers["scheduler"].parse_args(routed["scheduler"])
    worker = parsers["worker"].parse_args(routed["worker"])
    gateway = parsers["gateway"].parse_args(routed["gateway"])
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.enable_prefix_caching) == (8, 512, False)
    assert sched.scheduler_worker_address == worker.scheduler_worker_address == "tcp://127.0.0.1:7000"
    assert (worker.num_gpu_blocks_override, worker.max_num_batched_tokens, worker.dtype) == (64, 512, "float32")
    assert worker.model == gateway.model == "m.gguf" and gateway.port == 6000
    assert worker.max_num_seqs == 8  # it bounds the size of a plan the worker accepts
    assert "--no-enable-prefix-caching" not in routed["worker"] and "--port" not in routed["scheduler"]


def test_unknown_or_incomplete_flags_are_errors():
    parsers = process_parsers()
    with pytest.raises(FlagError, match="unknown flag --max-num-seq"):
        route_flags(["--max-num-seq", "8"], parsers)
    with pytest.raises(FlagError, match="needs a value"):
        route_flags(["--max-num-seqs"], parsers)


def test_a_flag_shared_by_processes_means_the_same_in_each():
    parsers = process_parsers()
    seen = {}
    for name, parser in parsers.items():
        for flag, action in parser._option_string_actions.items():
            if flag.startswith("--") and flag != "--help":
                seen.setdefault(flag, []).append((name, action.default, action.type, action.nargs))
    for flag, owners in seen.items():
        assert len({o[1:] for o in owners}) == 1, (flag, owners)


def test_speculative_config_reaches_the_worker_from_serve_and_from_llm_keywords():
    import json

    from pagoda.offline import _flags
    from worker.speculation.config import SpeculativeConfig
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    parsers = process_parsers()
    for argv in (["--speculative-config", json.dumps(spec)],         # pagoda serve / make run ARGS=
                 _flags({"speculative_config": spec, "dtype": "float32"})):  # LLM(speculative_config=)
        routed = route_flags(argv, parsers)
        worker = parsers["worker"].parse_args(routed["worker"])
        assert SpeculativeConfig.parse(worker.speculative_config) == SpeculativeConfig(
            "ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
        assert "--speculative-config" not in routed["scheduler"] + routed["gateway"]


BAD = [  # (flags, the one line that names what is wrong)
    (["--speculative-config", '{"method": "bogus"}'],
     "argument --speculative-config: method must be one of ['ngram', 'draft_model', 'suffix'], got "
     "'bogus'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     "argument --speculative-config: num_speculative_tokens must be an integer in [1, 16], got 99"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    # numbers out of their range (process_life/flag_types.py): each was taken, and went wrong later
    (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),  # served on 4464
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),  # served nothing
    (["--max-num-seqs", "-5"], "argument --max-num-seqs: must be >= 1, got -5"),  # worker crash loop
    (["--zmq-hwm", "0"], "argument --zmq-hwm: must be >= 1, got 0"),  # unbounded queues
    (["--gpu-memory-utilization", "5"], "argument --gpu-memory-utilization: must be in (0, 1], got 5"),
    (["--worker-timeout", "0"], "argument --worker-timeout: must be > 0, got 0"),
    (["--model", "/no/such/model.gguf"],
     "--model '/no/such/model.gguf': no such file or directory (no model hub is reached)"),
    (["--max-model-len", "9000"],  # SmolLM2's 8192: RoPE extrapolates past them without an error
     "--max-model-len 9000 is beyond the 8192 positions the model was trained on "
     "(max_position_embeddings); --allow-long-max-model-len serves it anyway, with answers that "
     "degrade past them"),
    (["--speculative-config", '{"method": "draft_model", "model": "/no/draft", "num_speculative_tokens": 2}'],
     "--speculative-config.model '/no/draft': no such file or directory (no model hub is reached)"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_the_launcher_refuses_bad_flags_before_it_starts_anything(argv, message):
    """Exit 2 (FlagError) with one line, rather than a worker that fails its start again at
    every restart; the offline LLM raises ValueError with the same line, having started nothing."""
    from launch.flag_routing import check_flags
    from pagoda.offline import LLM
    parsers = process_parsers()
    with pytest.raises(FlagError) as refused:
        check_flags(route_flags(argv, parsers), parsers)
    assert (refused.value.code, str(refused.value)) == (2, message)
    engine = dict(zip([a[2:].replace("-", "_") for a in argv[::2]], argv[1::2]))
    if "speculative_config" in engine:
        engine["speculative_config"] = json.loads(engine["speculative_config"])
    with pytest.raises(ValueError) as raised:
        LLM(insecure=True, **engine)
    assert str(raised.value) == message


def test_the_launcher_prints_the_line_and_exits_2():
    import subprocess
    import sys
    from tests.cluster import ROOT
    done = subprocess.run([sys.executable, "-m", "launch", *BAD[0][0]], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (2, f"pagoda: {BAD[0][1]}\n", "")


def test_good_flags_pass_the_launchers_check():
    from launch.flag_routing import check_flags
    parsers = process_parsers()
    spec = '{"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 2}'
    args = check_flags(route_flags(["--speculative-config", spec, "--max-num-seqs", "4", "--max-model-len",
                                    "9000", "--allow-long-max-model-len"], parsers), parsers)
    worker = args["worker"]
    assert (worker.speculative_config, args["scheduler"].max_num_seqs, worker.max_model_len) == (spec, 4, 9000)
