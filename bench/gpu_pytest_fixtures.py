"""The fixtures of tests/conftest.py that the kernel tests use, as a pytest plugin for
bench/gpu_check.sh: `pytest --noconftest -p bench.gpu_pytest_fixtures ...`. The conftest itself
imports grpc, uvloop and the cluster helpers, which the device machine lacks; without this plugin
every test module marked usefixtures("one_cpu_thread") errors at setup under --noconftest."""
from __future__ import annotations

import os

import pytest
import torch

# As tests/conftest.py: without CUDA (a dry run of the script) the kernels run under the Triton
# interpreter, which must be chosen before any test module imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """As tests/conftest.py's: the float64 references are tiny, torch's thread pool only adds
    contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
