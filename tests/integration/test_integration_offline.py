"""The offline API (`from pagoda import LLM, SamplingParams`) and the `pagoda` command on the real
model: outputs equal transformers' greedy generate, token for token and where they stop; the
children stop with close() and die with a parent that is killed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from proto import pagoda_pb2 as pb
from tests.cluster import ROOT, wait_for
from tests.integration.test_integration_api import chat_ids, hf_generate, hf_tokenizer  # noqa: F401 - a fixture
from tests.integration.test_integration_beam import NEW_TOKENS, hf_beams

pytestmark = pytest.mark.integration

FLAGS = dict(dtype="float32", num_gpu_blocks_override=256, max_num_seqs=8)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose: it waits only for its parent to reap it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_llm_generate_and_chat_equal_transformers(smollm2_hf, hf_tokenizer):
    from pagoda import LLM, BeamSearchParams, GenerationError, SamplingParams, StructuredOutputsParams

    prompts = ["The three primary colors are", "def fibonacci(n):"]
    with LLM(**FLAGS) as llm:
        pids = [c.proc.pid for c in llm._procs]
        keys = llm._own_keys
        assert keys.is_dir()
        outs = llm.generate(prompts + [[504, 3575, 282]],
                            SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        assert [o.prompt for o in outs[:2]] == prompts and outs[2].prompt_token_ids == [504, 3575, 282]
        for out in outs:  # in input order, each as transformers continues it
            assert out.outputs[0].token_ids == hf_generate(smollm2_hf, out.prompt_token_ids, 24)
            assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
            assert out.outputs[0].metrics.e2e_time_s > 0

        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = llm.chat(question, SamplingParams(temperature=0, max_tokens=64, logprobs=2),
                          use_tqdm=False)[0]
        assert answer.prompt_token_ids == chat_ids(hf_tokenizer, question[0]["content"])
        chat = answer.outputs[0]
        reference = hf_generate(smollm2_hf, answer.prompt_token_ids, 64)
        assert chat.token_ids == reference  # it ends at EOS, where transformers does
        assert (chat.finish_reason, chat.stop_reason) == ("stop", reference[-1])
        assert [len(p) for p in chat.logprobs] and all(t in p for t, p in zip(chat.token_ids, chat.logprobs))

        # Beam search, as vLLM's LLM.beam_search: the beams best first, as transformers' are.
        ids = [504, 3575, 282, 4649, 314]
        beams = llm.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=NEW_TOKENS))[0]
        expected = hf_beams(smollm2_hf, ids, 2, 1.0, "false")
        assert [c.token_ids for c in beams.outputs] == [tokens for tokens, _ in expected]
        assert beams.outputs[0].cumulative_logprob == pytest.approx(expected[0][1], abs=0.05)

        # Structured outputs, as vLLM's offline API takes them: the answer validates.
        schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                  "properties": {"city": {"type": "string", "maxLength": 16},
                                 "country": {"type": "string", "maxLength": 16}}}
        shaped = llm.chat([{"role": "user", "content": "Name a city and its country as JSON."}],
                          SamplingParams(temperature=0, max_tokens=60, structured_outputs=
                                         StructuredOutputsParams(json=schema)), use_tqdm=False)[0]
        assert shaped.outputs[0].finish_reason == "stop", shaped.outputs[0].text
        jsonschema.validate(json.loads(shaped.outputs[0].text), schema)
        with pytest.raises(GenerationError) as refused:
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
                         use_tqdm=False)
        assert refused.value.code == "INVALID_ARGUMENT"
        assert str(refused.value).startswith("INVALID_ARGUMENT: sampling.structured_output.regex: ")

        # vLLM's prompt dicts answer as the plain prompts do (greedy: the same tokens)
        plain = [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids]
        dicts = llm.generate([{"prompt": prompts[0]}, {"prompt_token_ids": [504, 3575, 282], "cache_salt": "s"}],
                             SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        assert [d.outputs[0].token_ids for d in dicts] == plain
        # Bad counts are refused before anything is built for them (n = 10^9 built a list of
        # n outputs first: 20 GB, and the OOM killer), numbers past their field name it.
        rss = _rss_bytes()
        with pytest.raises(GenerationError, match="sampling.n must be between 1 and 16"):
            llm.generate("x", SamplingParams(n=10**9), use_tqdm=False)
        assert _rss_bytes() - rss < 100 << 20
        for params, field in ((SamplingParams(seed=-2**63 - 1), "SamplingParams.seed"),
                              (SamplingParams(top_k=2**40), "SamplingParams.top_k")):
            with pytest.raises(ValueError, match=f"^{field}: "):
                llm.generate("x", params, use_tqdm=False)
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate({"prompt": "x", "multi_modal_data": {}}, use_tqdm=False)
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=15)
    assert not keys.exists()  # its secret keys do not outlive it in /tmp


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_script_that_never_closes_its_llm_exits_cleanly():
    """Closed at exit, before the interpreter's teardown: __del__ alone came when the loop's
    thread no longer ran, waited 10 s and printed a traceback."""
    script = ("from pagoda import LLM, SamplingParams\n"
              f"llm = LLM(**{FLAGS!r})\n"
              "print(len(llm.generate('Hi', SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids))\n"
              "print(llm._own_keys)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    count, keys = done.stdout.split()
    assert done.returncode == 0 and count == "2", done.stderr[-2000:]
    assert not os.path.exists(keys)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]


def test_no_orphans_when_the_parent_is_killed():
    script = (
        "import json, sys, time\n"
        "from pagoda import LLM, SamplingParams\n"
        f"llm = LLM(**{FLAGS!r})\n"
        "out = llm.generate('Once upon a time', SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "print(json.dumps([c.proc.pid for c in llm._procs]), len(out[0].outputs[0].token_ids), flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids_json, count = parent.stdout.readline().rsplit(" ", 1)
        pids = json.loads(pids_json)
        assert int(count) == 4 and all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        start = time.monotonic()
        assert wait_for(lambda: not any(alive(p) for p in pids), timeout=30)
        print(f"children gone {time.monotonic() - start:.1f} s after kill -9 of their parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_pagoda_generate_command(cluster, stub):
    expected = stub.Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_tokens=32)),
        timeout=300)
    for stream in ([], ["--stream"]):
        done = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--chat",
                               "What is the capital of France?", "--max-tokens", "32",
                               "--target", cluster.target, *stream],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected.text + "\n"
        assert "FINISH_REASON_STOP" in done.stderr
