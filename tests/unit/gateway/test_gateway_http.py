"""The OpenAI-compatible HTTP API of the gateway, with the real `openai` client and real HTTP,
against the fake scheduler of tests/fake_scheduler.py (no model): shapes, streaming, n > 1,
logprobs, errors and their status codes, cancel. tests/integration/test_integration_http.py runs the same
client against the real stack."""
from __future__ import annotations

import asyncio
import functools
import json
import re

import httpx2 as httpx  # what the openai client itself runs on
import openai
import pytest

from proto import internal_pb2 as ipb, pagoda_pb2 as pb
from tests.fake_scheduler import DEFAULT_REPLY as REPLY, local_gateway, reply_plan, until
from tests.unit.gateway.test_gateway_api import LP_IDS, TOK, expected_logprobs, logprobs_plan

harness = functools.partial(local_gateway, TOK, http=True)
MODEL = TOK.name
CHAT = [{"role": "user", "content": "Say hello"}]


def client(h) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=h.base_url, api_key="unused", max_retries=0)


def test_chat_whole_and_streamed(run):
    async def body():
        async with harness() as h:
            c = client(h)
            whole = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
            assert whole.object == "chat.completion" and whole.model == MODEL
            assert [(ch.index, ch.message.role, ch.message.content, ch.finish_reason)
                    for ch in whole.choices] == [(0, "assistant", REPLY, "length")]
            reply_tokens = len(TOK.encode(REPLY, add_special_tokens=False))
            prompt_tokens = len(h.scheduler.adds[-1].prompt_token_ids)
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens,
                    whole.usage.total_tokens) == (prompt_tokens, reply_tokens, prompt_tokens + reply_tokens)
            # What the scheduler got: the chat template's prompt, max_tokens as sent; the answer
            # whole (AddRequest.final_only), as it is not streamed.
            assert h.scheduler.adds[-1].max_tokens == 50 and h.scheduler.adds[-1].final_only

            stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                     stream_options={"include_usage": True})
            assert not h.scheduler.adds[-1].final_only
            chunks = [ch async for ch in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == REPLY
            finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply_tokens
    run(body())


def test_completions_batch_with_n_and_echo(run):
    async def body():
        async with harness() as h:
            c = client(h)
            out = await c.completions.create(model=MODEL, prompt=["One", "Two"], n=2, echo=True)
            assert [(ch.index, ch.text) for ch in out.choices] == [
                (0, "One" + REPLY), (1, "One" + REPLY), (2, "Two" + REPLY), (3, "Two" + REPLY)]
            assert {a.max_tokens for a in h.scheduler.adds[-2:]} == {16}  # OpenAI's default
            texts: dict[int, str] = {}
            async for ch in await c.completions.create(model=MODEL, prompt=[1, 2, 3], n=3,
                                                       stream=True):
                for choice in ch.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
            assert texts == {0: REPLY, 1: REPLY, 2: REPLY}
            assert list(h.scheduler.adds[-1].prompt_token_ids) == [1, 2, 3]
    run(body())


def test_logprobs_in_both_shapes(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = logprobs_plan
            c = client(h)
            want = expected_logprobs()
            chat = await c.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True,
                                                   top_logprobs=2)
            got = chat.choices[0].logprobs.content
            assert [(e.token, e.logprob, e.bytes) for e in got] == [
                (w.text, pytest.approx(w.logprob), list(w.token_bytes)) for w in want]
            assert [[(t.token, pytest.approx(t.logprob)) for t in e.top_logprobs] for e in got] == [
                [(t.text, pytest.approx(t.logprob)) for t in w.top_logprobs] for w in want]
            assert h.scheduler.adds[-1].sampling.logprobs == 2

            cmpl = await c.completions.create(model=MODEL, prompt="Say hello", logprobs=2)
            lp = cmpl.choices[0].logprobs
            assert lp.tokens == [w.text for w in want]
            assert lp.token_logprobs == [pytest.approx(w.logprob) for w in want]
            assert lp.text_offset == [sum(len(w.text) for w in want[:i]) for i in range(len(want))]
            assert cmpl.choices[0].text == TOK.decode(LP_IDS)
    run(body())


@pytest.mark.parametrize("payload, status, param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),           # without logprobs: true
    ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"max_tokens": -5}, 400, "max_tokens"),              # the name the client sent
    ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"bogus": 1, "tools": []}, 400, "bogus"),             # unknown fields are named
    ({"n": "two"}, 400, "n"),
    ({"stop": ["a", 5]}, 400, "stop"),                   # a union's field, not its branch ("stop.str")
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ({"model": "other-model"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(run, payload, status, param):
    async def body():
        async with harness() as h:
            request = {"model": MODEL, "messages": CHAT, **payload}
            async with httpx.AsyncClient() as http:
                r = await http.post(f"{h.base_url}/chat/completions", json=request)
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["message"] and error["type"]
            assert not h.scheduler.adds  # nothing reached the scheduler
    run(body())


# Numbers past the proto field they are copied into (protobuf raised ValueError: a 500, and the
# connection reset under the client's next request), or below an unsigned one.
OUT_OF_RANGE = [("chat/completions", field, value) for field, value in [
    ("seed", 2**70), ("seed", -2**63 - 1), ("top_k", 2**32), ("min_tokens", 2**31), ("priority", -2**40),
    ("truncate_prompt_tokens", 2**63), ("max_completion_tokens", 2**70), ("max_tokens", -2**31 - 1),
    ("top_logprobs", 2**40)]] + [("completions", "logprobs", 2**40), ("completions", "prompt_logprobs", -2**63)]


def test_numbers_out_of_range_get_400_naming_them_on_a_connection_that_goes_on(run):
    async def body():
        async with harness() as h:
            async with httpx.AsyncClient() as http:  # one connection, kept alive throughout
                for path, field, value in OUT_OF_RANGE:
                    request = {"model": MODEL, **({"messages": CHAT} if path.startswith("chat") else {"prompt": "hi"}),
                               field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
                    r = await http.post(f"{h.base_url}/{path}", json=request)
                    assert r.status_code == 400, (field, value, r.text)
                    assert r.json()["error"]["param"] == field, (field, r.text)
                    r = await http.post(f"{h.base_url}/chat/completions", json={"model": MODEL, "messages": CHAT})
                    assert r.status_code == 200, (field, r.text)
                assert len(h.scheduler.adds) == len(OUT_OF_RANGE)  # only the good ones reached it
    run(body())


def test_a_negative_seed_is_vllms_int64_and_travels_as_its_64_bits(run):
    """vLLM takes an int64 seed, the gRPC field is a uint64: -5 is the seed 2**64 - 5."""
    async def body():
        async with harness() as h:
            async with httpx.AsyncClient() as http:
                for seed in (-5, -2**63, 2**64 - 1):
                    r = await http.post(f"{h.base_url}/completions", json={"model": MODEL, "prompt": "hi", "seed": seed})
                    assert r.status_code == 200, r.text
            return [a.sampling.seed for a in h.scheduler.adds]
    assert run(body()) == [2**64 - 5, 2**63, 2**64 - 1]


def test_a_bug_gets_a_500_without_detail_and_the_connection_serves_the_next_request(run, monkeypatch):
    import gateway.rest.http_server
    real = gateway.rest.http_server.chat_request
    calls = []

    def first_fails(body):
        calls.append(body)
        if len(calls) == 1:
            raise RuntimeError("secret detail")
        return real(body)
    monkeypatch.setattr(gateway.rest.http_server, "chat_request", first_fails)
    request = json.dumps({"model": MODEL, "messages": CHAT}).encode()

    async def body():
        async with harness() as h:
            reader, writer = await asyncio.open_connection("127.0.0.1", h.gateway.http_port)
            replies = []
            for _ in range(2):  # both on one connection: the first one's bug must not end it
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
                replies.append((head, json.loads(await reader.readexactly(length))))
            writer.close()
            (head, error), (ok_head, ok) = replies
            assert head.startswith(b"HTTP/1.1 500") and error["error"]["type"] == "internal_error"
            assert "secret" not in json.dumps(error)
            assert ok_head.startswith(b"HTTP/1.1 200") and ok["choices"][0]["message"]["content"] == REPLY
    run(body())


def test_transport_errors(run):
    async def body():
        async with harness(max_http_body_bytes=2000) as h:
            async with httpx.AsyncClient() as http:
                url = f"{h.base_url}/completions"
                r = await http.post(url, content=b"{not json")
                assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
                r = await http.post(url, json={"model": MODEL, "prompt": "x" * 5000})
                assert r.status_code == 413 and "--max-http-body-bytes" in r.json()["error"]["message"]

                def refuse(add):
                    return [ipb.TokenDelta(request_id=add.request_id, finish=ipb.ERROR, error=ipb.Error(
                        code="RESOURCE_EXHAUSTED", message="the waiting queue is full"))]
                h.scheduler.plan = refuse
                r = await http.post(url, json={"model": MODEL, "prompt": "hi"})
                assert r.status_code == 429 and r.json()["error"]["message"] == "the waiting queue is full"
                # Streaming: an error before the first token is still a status; one after it
                # comes as an event, then [DONE].
                r = await http.post(url, json={"model": MODEL, "prompt": "hi", "stream": True})
                assert r.status_code == 429
                h.scheduler.plan = lambda add: [reply_plan(TOK)(add)[0], *refuse(add)]
                r = await http.post(url, json={"model": MODEL, "prompt": "hi", "stream": True})
                events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")[:-2]]
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                assert events[0]["choices"][0]["text"] == TOK.decode(
                    TOK.encode(REPLY, add_special_tokens=False)[:1])
                assert events[-1]["error"]["code"] == "resource_exhausted"

                await h.scheduler.set_workers(0)
                await until(lambda: h.gateway.client.info.num_workers == 0)
                r = await http.post(url, json={"model": MODEL, "prompt": "hi"})
                assert r.status_code == 503
                assert (await http.get(f"http://127.0.0.1:{h.gateway.http_port}/health")).status_code == 503
    run(body())


def test_closing_the_connection_aborts(run):
    async def body():
        async with harness() as h:
            h.scheduler.plan = reply_plan(TOK, delay=0.2)
            async with httpx.AsyncClient() as http:
                async with http.stream("POST", f"{h.base_url}/completions", json={
                        "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 100}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # one chunk, then hang up
            await until(lambda: h.scheduler.aborts)
            assert h.scheduler.aborts == [h.scheduler.adds[-1].request_id]

            # A whole (non-streamed) request too: the client gives up before the answer.
            with pytest.raises(httpx.ReadTimeout):
                async with httpx.AsyncClient(timeout=0.5) as http:
                    await http.post(f"{h.base_url}/completions",
                                    json={"model": MODEL, "prompt": "hi", "max_tokens": 100})
            await until(lambda: len(h.scheduler.aborts) == 2)
            assert h.scheduler.aborts[-1] == h.scheduler.adds[-1].request_id

            # Before the first token (queued, or a beam search, whose answer comes whole at the
            # end): the hang-up aborts too. It ran to its end before, the client long gone.
            h.scheduler.plan = lambda add: []  # nothing comes back
            for extra in ({}, {"stream": True}, {"use_beam_search": True, "n": 2}):
                with pytest.raises(httpx.ReadTimeout):
                    async with httpx.AsyncClient(timeout=0.5) as http:
                        await http.post(f"{h.base_url}/completions",
                                        json={"model": MODEL, "prompt": "hi", "max_tokens": 100, **extra})
                await until(lambda: h.scheduler.aborts[-1] == h.scheduler.adds[-1].request_id)
            assert len(h.scheduler.aborts) == 5
    run(body())


def test_models_tokenize_detokenize_metrics(run):
    async def body():
        async with harness() as h:
            models = await client(h).models.list()
            assert [(m.id, m.object) for m in models.data] == [(MODEL, "model")]
            assert (await client(h).models.retrieve(MODEL)).id == MODEL
            with pytest.raises(openai.NotFoundError) as e:
                await client(h).models.retrieve("other/model")
            assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
            root = f"http://127.0.0.1:{h.gateway.http_port}"
            async with httpx.AsyncClient() as http:
                # no such route, or not this method: OpenAI's error shape all the same
                for r, status in ((await http.post(f"{root}/v1/embeddings", json={}), 404),
                                  (await http.get(f"{root}/v1/chat/completions"), 405)):
                    assert r.status_code == status and set(r.json()) == {"error"}, r.text
                    assert r.json()["error"]["type"] == "invalid_request_error"
                r = await http.post(f"{root}/tokenize", json={"model": MODEL, "prompt": "Héllo wörld"})
                ids = TOK.encode("Héllo wörld", add_special_tokens=True)
                assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
                r = await http.post(f"{root}/detokenize", json={"tokens": ids})
                assert r.json() == {"prompt": TOK.decode(ids)}
                r = await http.post(f"{root}/detokenize", json={"tokens": [10 ** 9]})
                assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
                # the field at fault in the servicer's refusal, as param (it was null)
                r = await http.post(f"{root}/tokenize", json={"messages": [{"role": "user", "content": "x"}] * 300})
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
                r = await http.post(f"{root}/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
                assert (await http.get(f"{root}/health")).status_code == 200
    run(body())


def test_public_metrics_are_the_cluster_gauges_routers_read_and_nothing_else(run):
    async def body():
        async with harness(api_keys=("s3cret",)) as h:
            h.scheduler.loads = pb.GetLoadsResponse(num_pending=2, workers=[
                pb.WorkerLoad(worker_id="host-a-17", running=3, waiting=1, kv_blocks_used=30,
                              kv_blocks_total=100),
                pb.WorkerLoad(worker_id="host-b-18", running=1, waiting=0, kv_blocks_used=10,
                              kv_blocks_total=100)])
            async with httpx.AsyncClient() as http:
                r = await http.get(f"http://127.0.0.1:{h.gateway.http_port}/metrics")  # no key
                calls = len(h.scheduler.calls)
                again = await http.get(f"http://127.0.0.1:{h.gateway.http_port}/metrics")
            assert r.status_code == 200, r.text
            samples = {line.split(" ")[0]: float(line.split(" ")[1])
                       for line in r.text.splitlines() if line and not line.startswith("#")}
            assert {name.split("{")[0]: v for name, v in samples.items()} == {
                "vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 3.0,
                "vllm:kv_cache_usage_perc": 0.2}
            assert "host-" not in r.text and "pagoda_gateway" not in r.text and "s3cret" not in r.text
            # A second scrape within the second is the first page: scrapes cannot load the scheduler.
            assert again.text == r.text and len(h.scheduler.calls) == calls
    run(body())


def test_http_port_equal_to_grpc_port_is_refused():
    from gateway.gateway_flags import parse_gateway_args
    with pytest.raises(SystemExit):
        parse_gateway_args(["--port", "9000", "--http-port", "9000"])
    assert parse_gateway_args(["--port", "9000", "--http-port", "0"]).http_port == 0


def test_api_key_guards_the_http_api_too(run):
    async def body():
        async with harness(api_keys=("s3cret",)) as h:
            with pytest.raises(openai.AuthenticationError) as e:
                await client(h).chat.completions.create(model=MODEL, messages=CHAT)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
            assert not h.scheduler.adds
            keyed = openai.AsyncOpenAI(base_url=h.base_url, api_key="s3cret", max_retries=0)
            out = await keyed.chat.completions.create(model=MODEL, messages=CHAT)
            assert out.choices[0].message.content == REPLY
            # The key's tenant namespaces the request id at the scheduler, as on gRPC.
            assert h.scheduler.adds[-1].public_id.startswith("k") and "/" in h.scheduler.adds[-1].public_id
            async with httpx.AsyncClient() as http:
                root = f"http://127.0.0.1:{h.gateway.http_port}"
                assert (await http.get(f"{root}/health")).status_code == 200  # open, as on gRPC
                assert (await http.post(f"{root}/tokenize", json={"prompt": "x"})).status_code == 401
    run(body())
