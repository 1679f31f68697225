"""Fixtures shared by test modules."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# Triton takes TRITON_INTERPRET when it is first imported: its language's own @jit helpers are
# made then, and a kernel interpreted later cannot call them. Without CUDA the kernel tests run
# under the interpreter, so it is set before any test module (or a library) imports Triton;
# which module did first used to depend on the test order (pytest-randomly).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The workers' kept start-up measurements (worker/startup/kept.py: row bounds, the decode step's bound, the
# prefill rate) go to a folder of the suite's own, which its processes inherit: timed while tests
# load the machine, they would otherwise steer a later `make run` from the user's cache folder.
# Kept across runs all the same, so that a run does not time every configuration again.
os.environ.setdefault("PAGODA_MEASUREMENTS", os.path.join(os.path.expanduser("~"), ".cache", "pagoda-tests"))

import grpc  # noqa: E402
import pytest  # noqa: E402
import uvloop  # noqa: E402

from proto import pagoda_pb2_grpc  # noqa: E402
from tests.cluster import Cluster  # noqa: E402


@pytest.fixture(scope="module")
def run():
    """Runs a coroutine to completion on a module-wide uvloop loop (the gateway's own loop)."""
    loop = uvloop.new_event_loop()
    yield lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 30))
    loop.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The real stack with the real model, shared by every integration module that needs no
    flags of its own (a start costs tens of seconds on two cores)."""
    log = tmp_path_factory.mktemp("cluster") / "cluster.log"
    c = Cluster("--dtype", "float32", "--num-gpu-blocks-override", "256", "--max-num-seqs", "32",
                log_path=log).start()
    yield c
    code = c.stop()
    assert code == 0, c.log_tail()


@pytest.fixture(scope="session")
def client(cluster):
    """The real openai client against the session cluster's HTTP port."""
    import openai
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model(stub):
    """The session cluster's model name, as the OpenAI API takes it."""
    from proto import pagoda_pb2
    return stub.GetModelInfo(pagoda_pb2.GetModelInfoRequest(), timeout=30).model


@pytest.fixture(scope="session")
def stub(cluster):
    channel = grpc.insecure_channel(cluster.target)
    yield pagoda_pb2_grpc.GenerationStub(channel)
    channel.close()


_smollm2_hf: Future | None = None


def _load_smollm2_hf():
    import torch
    from transformers import AutoModelForCausalLM

    from modelfiles.resolve import resolve_model
    path = resolve_model("")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected what will not run
def pytest_collection_modifyitems(session, config, items):
    """transformers takes about 35 s to convert the GGUF, nearly all of it single-threaded
    Python: begin at once, beside the session cluster's start, if any selected test needs it."""
    global _smollm2_hf
    if any("smollm2_hf" in getattr(item, "fixturenames", ()) for item in items):
        import transformers  # noqa: F401 - imported here, so that no two threads import it at once
        _smollm2_hf = ThreadPoolExecutor(1, thread_name_prefix="smollm2-hf").submit(_load_smollm2_hf)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own SmolLM2 from the same GGUF file, in fp32: the reference for outputs."""
    return _smollm2_hf.result() if _smollm2_hf else _load_smollm2_hf()


@pytest.fixture(scope="module")
def one_cpu_thread():
    """For modules of tiny tensors: torch's thread pool only adds contention (10x slower on 2
    shared cores)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
