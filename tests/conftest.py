"""Fixtures shared by test modules."""
from __future__ import annotations

import asyncio

import pytest
import uvloop


@pytest.fixture(scope="module")
def run():
    """Runs a coroutine to completion on a module-wide uvloop loop (the gateway's own loop)."""
    loop = uvloop.new_event_loop()
    yield lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 30))
    loop.close()
