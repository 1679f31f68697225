#!/usr/bin/env bash
# Downloads, here, the wheels bench/gpu_check.sh needs on the device machine (Python 3.12, x86_64,
# no network; CUDA torch and triton preinstalled, nothing else assumed) into .whl/ (ignored by
# git; carried by the device call, which carries at most 64 MiB). gpu_check.sh unpacks each one
# only where its module is missing, except protobuf, which must match the generated proto code.
#   protobuf        proto/*_pb2.py (generated for 7.36.2)
#   pyzmq, tqdm     imported by worker/ and proto/ (proto.auth, the runner's progress bar)
#   safetensors     the random models' checkpoints (bench/random_model.py, worker/model/loader.py)
#   numpy           worker/ and scheduler/ (a CUDA torch image usually has it: 16 MB, kept off
#                   the image's own copy unless missing)
#   pytest + deps   the kernel tests (pluggy, iniconfig, packaging, pygments)
#   gguf            worker/model/loader.py for .gguf models (the SmolLM2 wheel's format; small)
# Not carried: transformers and its dependencies (~25 MB more; bench/e2e_gpu.py skips its
# baselines without it) and xgrammar (imports transformers; the grammar-mask CUDA test runs only
# where the image has it); the SmolLM2 model wheel (93 MB, over the limit: random models of its
# shape stand in).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# The repo's pins (pyproject.toml; pytest's dependencies as this venv resolved them).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    protobuf==7.36.2 gguf==0.19.0 pyzmq==27.3.0 tqdm==4.70.1 safetensors==0.8.0 numpy==2.4.6 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
ls -l .whl
du -ch .whl/*.whl | tail -1
# What the device call carries besides: the generated proto modules (ignored by git).
for f in proto/internal_pb2.py proto/pagoda_pb2.py; do
    [ -f "$f" ] || { echo "missing $f: run make proto (or make install) first" >&2; exit 1; }
done
