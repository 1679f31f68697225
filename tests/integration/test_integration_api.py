"""The public API with the real model against transformers: where answers end (EOS), logprobs and
prompt logprobs, and the sampling fields, over the real stack (tests/conftest.py's cluster)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from proto import pagoda_pb2 as pb

pytestmark = pytest.mark.integration

IM_END = 2  # SmolLM2's <|im_end|>, its end-of-turn and EOS token
CHAT_PROMPTS = ["What is the capital of France?", "What is 2 + 2?", "Name three colors.",
                "Who wrote Hamlet?", "Say hello in French."]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from modelfiles.resolve import cache_dir, resolve_model
    # The gateway converted the GGUF's vocabulary once with transformers itself; reuse that folder.
    return AutoTokenizer.from_pretrained(str(cache_dir(resolve_model(""), "tokenizer")))


def chat_ids(hf_tokenizer, content: str) -> list[int]:
    return list(hf_tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=IM_END, **kw)
    return out[0, len(ids):].tolist()


def greedy(prompt_ids: list[int], max_tokens: int, **fields) -> pb.GenerateRequest:
    stopping = {k: fields.pop(k) for k in ("min_tokens", "ignore_eos", "stop") if k in fields}
    return pb.GenerateRequest(prompt_token_ids=prompt_ids,
                              sampling=pb.SamplingParams(temperature=0, **fields),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens, **stopping))


def test_model_info_reports_what_the_scheduler_stops_on(stub):
    assert list(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).eos_token_ids) == [IM_END]


def test_chat_answers_end_at_eos_as_transformers_does(stub, smollm2_hf, hf_tokenizer):
    assert smollm2_hf.generation_config.eos_token_id in (IM_END, [IM_END])

    def answer(content: str) -> pb.GenerateResponse:
        return stub.Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=content)],
            sampling=pb.SamplingParams(temperature=0), stopping=pb.StoppingCriteria(max_tokens=128),
            return_prompt_token_ids=True), timeout=300)

    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:  # batched: each must still end alone
        answers = list(pool.map(answer, CHAT_PROMPTS))
    for content, got in zip(CHAT_PROMPTS, answers):
        ids = chat_ids(hf_tokenizer, content)
        assert list(got.prompt_token_ids) == ids, content
        reference = hf_generate(smollm2_hf, ids, 128)  # stops at its EOS, which it includes
        assert reference[-1] == IM_END and len(reference) < 128, content
        assert list(got.token_ids) == reference, content
        assert got.finish_reason == pb.FINISH_REASON_STOP, content
        assert got.matched_token_id == IM_END and got.usage.completion_tokens == len(reference)
        assert "<|im_end|>" not in got.text and got.text.strip()


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(stub, smollm2_hf, hf_tokenizer):
    prompt = hf_tokenizer.encode("The capital of France is", add_special_tokens=False)
    k, pk = 5, 3
    got = stub.Generate(greedy(prompt, 12, logprobs=k, prompt_logprobs=pk, ignore_eos=True), timeout=300)
    out = list(got.token_ids)
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([prompt + out])).logits[0].double()
    ref = torch.log_softmax(logits, dim=-1)  # row p scores the token at p + 1
    assert len(got.logprobs) == len(out) == 12
    for i, entry in enumerate(got.logprobs):
        row = ref[len(prompt) + i - 1]
        check_entry(entry, out[i], row, k)
        assert entry.rank == 1  # greedy samples the best token
    assert len(got.prompt_logprobs) == len(prompt) - 1
    for p, entry in enumerate(got.prompt_logprobs, start=1):
        check_entry(entry, prompt[p], ref[p - 1], pk)


def check_entry(entry: pb.TokenLogprob, token: int, row: torch.Tensor, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
    assert entry.rank == 1 + int((row > row[token]).sum())
    top_values, top_ids = row.topk(k)
    assert [t.token_id for t in entry.top_logprobs] == top_ids.tolist()
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert entry.token_bytes.decode("utf-8", "replace") == entry.text


def test_repetition_penalty_and_min_tokens_equal_transformers(stub, smollm2_hf, hf_tokenizer):
    ids = chat_ids(hf_tokenizer, "What is 2 + 2?")
    natural = hf_generate(smollm2_hf, ids, 64)
    assert natural[-1] == IM_END
    got = stub.Generate(greedy(ids, 40, repetition_penalty=1.3), timeout=300)
    assert list(got.token_ids) == hf_generate(smollm2_hf, ids, 40, repetition_penalty=1.3)
    longer = len(natural) + 6  # EOS is masked until then, so the answer must run past it
    got = stub.Generate(greedy(ids, 64, min_tokens=longer), timeout=300)
    reference = hf_generate(smollm2_hf, ids, 64, min_new_tokens=longer)
    assert list(got.token_ids) == reference and len(reference) > longer
    assert got.finish_reason == (pb.FINISH_REASON_STOP if reference[-1] == IM_END else pb.FINISH_REASON_LENGTH)


def test_logit_bias_decides_a_greedy_answer(stub, hf_tokenizer):
    token = hf_tokenizer.encode(" banana", add_special_tokens=False)[0]
    got = stub.Generate(greedy(chat_ids(hf_tokenizer, "Hi"), 6, logit_bias={token: 100.0}), timeout=120)
    assert list(got.token_ids) == [token] * 6


SAMPLED = [
    dict(temperature=0.8, top_p=0.9, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=1.0, min_p=0.1, repetition_penalty=1.2),
    dict(temperature=0.7, top_k=20, logit_bias={30: -5.0, 28: 3.0}),
]


@pytest.mark.parametrize("fields", SAMPLED, ids=["penalties", "min_p", "top_k_bias"])
def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(stub, hf_tokenizer, fields):
    ids = chat_ids(hf_tokenizer, "Write a sentence about the sea.")
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(seed=11, **fields),
                                 stopping=pb.StoppingCriteria(max_tokens=24, ignore_eos=True))
    alone = stub.Generate(request, timeout=300)
    others = [pb.GenerateRequest(prompt_token_ids=chat_ids(hf_tokenizer, q),
                                 sampling=pb.SamplingParams(temperature=1.0),
                                 stopping=pb.StoppingCriteria(max_tokens=30, ignore_eos=True))
              for q in CHAT_PROMPTS]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        futures = [pool.submit(stub.Generate, r, timeout=300) for r in [*others, request]]
        crowded = futures[-1].result()
        for f in futures:
            f.result()
    assert list(crowded.token_ids) == list(alone.token_ids) and len(alone.token_ids) == 24
    assert crowded.seed == alone.seed == 11


def test_an_unseeded_answer_reports_the_seed_that_replays_it(stub, hf_tokenizer):
    ids = chat_ids(hf_tokenizer, "Tell me a fun fact about cats.")
    sampling = dict(temperature=1.0, top_p=0.95)
    first = stub.Generate(pb.GenerateRequest(
        prompt_token_ids=ids, sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingCriteria(max_tokens=20, ignore_eos=True)), timeout=300)
    assert first.HasField("seed")
    replay = stub.Generate(pb.GenerateRequest(
        prompt_token_ids=ids, sampling=pb.SamplingParams(seed=first.seed, **sampling),
        stopping=pb.StoppingCriteria(max_tokens=20, ignore_eos=True)), timeout=300)
    assert list(replay.token_ids) == list(first.token_ids)


def test_stop_string_is_matched_and_optionally_kept(stub, hf_tokenizer):
    def ask(include: bool) -> pb.GenerateResponse:
        return stub.Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
            sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=32, stop=["Paris"],
                                         include_stop_str_in_output=include)), timeout=120)
    kept, dropped = ask(True), ask(False)
    assert kept.text == "The capital of France is Paris"
    assert dropped.text == "The capital of France is "
    for r in (kept, dropped):
        assert r.finish_reason == pb.FINISH_REASON_STOP and r.matched_stop_str == "Paris"
        assert r.WhichOneof("matched_stop") == "matched_stop_str"


def test_last_message_carries_metrics(stub, hf_tokenizer):
    messages = list(stub.GenerateStream(greedy(chat_ids(hf_tokenizer, "Hi"), 8, ignore_eos=True),
                                        timeout=120))
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.WhichOneof("matched_stop") is None
    m = last.metrics
    assert 0 <= m.queue_time_s <= m.time_to_first_token_s <= m.e2e_time_s
    assert m.num_preemptions == 0
    assert not any(msg.HasField("metrics") for msg in messages[:-1])


def test_a_unary_answer_times_its_first_token_when_it_came_not_when_it_was_read(stub, hf_tokenizer):
    """Unary Generate reads its tokens only at the end (gateway/scheduler_link/inbox.py): the time to first
    token is still the first token's arrival, one prefill and no decode steps after the request,
    so here well under the time of the 31 decode steps that follow it."""
    reply = stub.Generate(greedy(chat_ids(hf_tokenizer, "Hi"), 32, ignore_eos=True), timeout=120)
    assert len(reply.token_ids) == 32
    m = reply.metrics
    assert 0 <= m.queue_time_s <= m.time_to_first_token_s < m.e2e_time_s / 2
