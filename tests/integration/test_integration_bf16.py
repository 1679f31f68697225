"""The real model in bf16 over the real stack (`--dtype bfloat16`, what `--dtype auto` picks on
a CPU with bf16 instructions): its decode steps run as one C call (worker/model/fused_decode.py, bf16 weights), and
what it answers stays within bf16's rounding of transformers in fp32, teacher-forced on the same
tokens: every greedy token is fp32's best or within a small margin of it, and its logprob is
near fp32's."""
from __future__ import annotations

import pytest
import torch

from proto import pagoda_pb2 as pb
from tests.cluster import Cluster

pytestmark = pytest.mark.integration

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
TOKENS = 24
# On an AVX2 EPYC (stop 40) every one of the 72 greedy bf16 tokens was fp32's best, and the
# largest logprob difference was 0.117 (nats): bounds with room for another CPU's rounding.
MARGIN, LOGPROB_ERROR = 0.3, 0.25


@pytest.fixture(scope="module")
def bf16_stub(tmp_path_factory):
    import grpc

    from proto import pagoda_pb2_grpc
    log = tmp_path_factory.mktemp("bf16") / "cluster.log"
    cluster = Cluster("--dtype", "bfloat16", log_path=log).start()
    channel = grpc.insecure_channel(cluster.target)
    yield pagoda_pb2_grpc.GenerationStub(channel), log
    channel.close()
    cluster.stop()


def test_bf16_decodes_in_one_c_step_within_bf16s_rounding_of_fp32(bf16_stub, smollm2_hf):
    from transformers import AutoTokenizer

    from modelfiles.resolve import cache_dir, resolve_model
    stub, log = bf16_stub
    tokenizer = AutoTokenizer.from_pretrained(str(cache_dir(resolve_model(""), "tokenizer")))
    for text in PROMPTS:
        prompt = tokenizer.encode(text, add_special_tokens=False)
        got = stub.Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0, logprobs=1),
            stopping=pb.StoppingCriteria(max_tokens=TOKENS, ignore_eos=True)), timeout=300)
        out = list(got.token_ids)
        assert len(out) == TOKENS
        with torch.inference_mode():
            logits = smollm2_hf(torch.tensor([prompt + out])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)
        for i, (token, entry) in enumerate(zip(out, got.logprobs)):
            row = ref[len(prompt) + i - 1]
            assert row.max() - row[token] <= MARGIN, (text, i)
            assert abs(entry.logprob - row[token].item()) <= LOGPROB_ERROR, (text, i)
    assert "run as one C call (kernels/cpu_decode_layer.c, bf16 weights" in log.read_text()


def test_plain_greedy_answers_the_heads_max_the_same_tokens_as_the_samplers(bf16_stub, smollm2_hf):
    """A step whose rows are all plain greedy takes their tokens from the LM head's own max
    (worker/model/llama.py greedy_tokens); one with a row that asks for logprobs computes the logits
    and samples every row from them. Plain requests alone (the head's max) answer what they
    answer side by side with logprobs requests (the sampler's), which answer the same."""
    from transformers import AutoTokenizer

    from modelfiles.resolve import cache_dir, resolve_model
    stub, _ = bf16_stub
    tokenizer = AutoTokenizer.from_pretrained(str(cache_dir(resolve_model(""), "tokenizer")))

    def ask(text: str, logprobs: bool):
        sampling = pb.SamplingParams(temperature=0, logprobs=1) if logprobs else pb.SamplingParams(temperature=0)
        return stub.Generate.future(pb.GenerateRequest(
            prompt_token_ids=tokenizer.encode(text, add_special_tokens=False), sampling=sampling,
            stopping=pb.StoppingCriteria(max_tokens=TOKENS, ignore_eos=True)), timeout=300)

    together = [ask(text, plain) for text in PROMPTS for plain in (False, True)]
    answers = [list(f.result().token_ids) for f in together]
    for i in range(0, len(answers), 2):
        assert len(answers[i]) == TOKENS and answers[i] == answers[i + 1]
    alone = [list(ask(text, False).result().token_ids) for text in PROMPTS]
    assert alone == answers[::2]
