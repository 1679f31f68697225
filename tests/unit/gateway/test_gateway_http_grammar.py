"""The HTTP API's structured-output requests and the gateway's grammar check: a spec that waits
past --max-grammar-queue-seconds for a compiler gets 429, and the compilers are shared by tenant
(by peer without keys). A stand-in compiler (tests/unit/gateway/test_gateway_grammar_check.py)
against the fake scheduler."""
from __future__ import annotations

import asyncio
import time

import httpx2 as httpx

from tests.unit.gateway.test_gateway_http import MODEL, harness


def test_a_spec_that_waits_past_the_bound_for_a_compiler_gets_429(run):
    import sys
    from gateway.grammar.grammar_check import GrammarChecker
    from tests.unit.gateway.test_gateway_grammar_check import STAND_IN

    async def body():
        async with harness() as h:
            h.gateway.servicer.grammar.checker = GrammarChecker(None, lambda: (0, []), timeout_s=2.0, processes=1,
                                                         args=[sys.executable, "-c", STAND_IN], queue_s=0.3)
            async with httpx.AsyncClient(timeout=30) as http:
                def post(structured):
                    return asyncio.ensure_future(http.post(f"{h.base_url}/completions", json={
                        "model": MODEL, "prompt": "hi", "max_tokens": 2, "structured_outputs": structured}))
                slow = post({"regex": "slow"})
                await asyncio.sleep(0.5)  # the one compiler is warm and busy with it
                busy = await post({"regex": "b+"})
                await slow
            return busy.status_code, busy.json()["error"]

    status, error = run(body())
    assert (status, error["type"], error["param"]) == (429, "rate_limit_error", "structured_outputs")
    assert error["message"].startswith("structured_outputs: no grammar compiler was free "
                                       "within 0.3 s (--max-grammar-queue-seconds)")


def test_the_grammar_check_shares_its_compilers_by_tenant_and_without_keys_by_peer(run):
    """The HTTP API hands each request's client to the grammar check: with keys the tenant, so
    tenant A's two specs that never compile hold both compilers (nobody else asked) and tenant
    B's spec then waits for one of them, not for A's queue; without keys the client's address
    (a stand-in compiler; gateway/grammar/grammar_check.py's own tests hold the real one's pool)."""
    import sys
    from gateway.bounds.client_auth import tenant_of_key
    from gateway.grammar.grammar_check import GrammarChecker
    from tests.unit.gateway.test_gateway_grammar_check import STAND_IN

    async def body(keys, source):
        async with harness(api_keys=keys) as h:
            h.gateway.servicer.grammar.checker = checker = GrammarChecker(
                None, lambda: (0, []), timeout_s=1.0, args=[sys.executable, "-c", STAND_IN])
            transport = httpx.AsyncHTTPTransport(local_address=source)
            async with httpx.AsyncClient(timeout=30, transport=transport) as http:
                def post(key, structured):
                    return asyncio.ensure_future(http.post(
                        f"{h.base_url}/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "structured_outputs": structured}))
                slow = [post("key-a", {"regex": "slow"}), post("key-a", {"grammar": "slow"})]
                await asyncio.sleep(0.5)
                held = {c: checker.queue.held(c) for c in (tenant_of_key("key-a"), source)}
                started = time.monotonic()
                quick = await post("key-b", {"regex": "b+"})
                took = time.monotonic() - started
                refused = [(await s).status_code for s in slow]
            return quick.status_code, took < 2.5, refused, held

    assert run(body(("key-a", "key-b"), "127.0.0.1")) == (200, True, [400, 400], {"kf10f781241e22466/": 2, "127.0.0.1": 0})
    assert run(body((), "127.0.0.2")) == (200, True, [400, 400], {"kf10f781241e22466/": 0, "127.0.0.2": 2})
