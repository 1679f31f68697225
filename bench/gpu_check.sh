#!/usr/bin/env bash
# GPU check for one CUDA GPU, sized for an H200: about 6 minutes with Triton's compiles (cold cache).
# The checks that never ran on a GPU come first:
#   1. verify kernels: tests/unit/kernels/test_kernels_verify.py (speculative verification steps,
#      1 + k query rows up to k = 16, decode tiles, split-KV, prefill tiles, rewritten rejected
#      slots) and test_kernels.py's multi-token Triton cases (verify_k4, short_gqa8, tile_edges),
#      compiled, against float64
#   2. bench/spec_gpu_check.py: greedy speculative decoding (ngram, suffix, a self-draft at k = 4
#      and 16) gives the tokens of no speculation, in fp32 through the real scheduler and worker;
#      CUDA fp32 logits within 1e-4 of the CPU worker's; the bf16 runs reported
#   3. the other kernel tests on CUDA: test_kernels.py's Triton cases (bf16 included), KV write,
#      int64 offsets, the sm_90 spill check, test_kernels_cuda.py (graph capture, no syncs, a
#      decode speed floor); the grammar mask on CUDA logits where the image has xgrammar
#   4. bench/bench_attention.py: decode bandwidth against a device-to-device copy, prefill
#      against SDPA, config sweeps (markdown tables)
#   5. bench/e2e_gpu.py: end-to-end throughput on a random model of SmolLM2's shape
# Every step has its own timeout, cut to what is left of GPU_CHECK_BUDGET (seconds, default 330)
# so the whole fits, and writes $OUT/<n>-<name>.txt as it goes (tee, unbuffered); a summary goes
# to $OUT/gpu_check.log. A rerun of some steps: STEPS="4 5" bash bench/gpu_check.sh.
# Needs python3 with CUDA torch and triton (never installs torch); the rest comes as wheels in
# .whl/, made here by bench/prepare_gpu_wheels.sh. The device tool's call is then:
#   run(command="bash bench/gpu_check.sh", carry=[".whl", "proto/internal_pb2.py",
#       "proto/pagoda_pb2.py"], timeout_s=420)
# Exit status: the number of failed (or skipped for lack of time) steps.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET:-330}
STEPS=${STEPS:-1 2 3 4 5}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1                 # partial output reaches the files before a timeout
unset TRITON_INTERPRET
# fp32 checks need fp32 products: NGC images set this to run cuBLAS fp32 in TF32.
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE NVIDIA_TF32_OVERRIDE
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
failed=0
T0=$SECONDS
log() { echo "== [$((SECONDS - T0))s] $*" | tee -a "$OUT/gpu_check.log"; }

# Carried wheels: unpacked (a wheel is a zip of site-packages; no pip, no network) into
# /tmp/pagoda-site, each only where the image lacks its module, so the image's own builds stay;
# protobuf always, as the generated proto modules need its version.
if [ -d .whl ]; then
    "$PY" - >"$OUT/wheels.txt" 2>&1 <<'EOF' || log "could not unpack the wheels: $(tail -1 "$OUT/wheels.txt")"
import glob, importlib.util, zipfile
modules = {"protobuf": None, "pyzmq": "zmq", "pygments": "pygments", "gguf": "gguf", "numpy": "numpy",
           "tqdm": "tqdm", "safetensors": "safetensors", "pytest": "pytest", "pluggy": "pluggy",
           "iniconfig": "iniconfig", "packaging": "packaging"}
for wheel in sorted(glob.glob(".whl/*.whl")):
    dist = wheel.split("/")[-1].split("-")[0].lower()
    module = modules.get(dist, dist)
    if module is not None and importlib.util.find_spec(module) is not None:
        print(f"kept the image's {module}")
        continue
    zipfile.ZipFile(wheel).extractall("/tmp/pagoda-site")
    print(f"unpacked {wheel}")
EOF
    export PYTHONPATH="/tmp/pagoda-site:$PYTHONPATH"
    log "wheels: $(grep -c unpacked "$OUT/wheels.txt") unpacked, $(grep -c kept "$OUT/wheels.txt") kept from the image"
fi
if [ -d "${PAGODA_WHEELS:-shared/wheels}" ] && ! "$PY" -c 'import pytest' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links "${PAGODA_WHEELS:-shared/wheels}" pytest \
        >"$OUT/pip.txt" 2>&1 || log "no pytest from ${PAGODA_WHEELS:-shared/wheels}: $(tail -1 "$OUT/pip.txt")"
fi

if ! "$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"' 2>"$OUT/import.err"; then
    log "FAIL: $PY cannot import torch and triton with CUDA: $(tail -1 "$OUT/import.err")"
    exit 1
fi
log "$("$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)')"
log "$("$PY" -c 'import importlib
have, missing = [], []
for m in ("numpy", "zmq", "tqdm", "safetensors", "google.protobuf", "pytest", "xgrammar", "transformers"):
    try:
        have.append(m + " " + str(getattr(importlib.import_module(m), "__version__", "?")))
    except Exception:
        missing.append(m)
print("have:", ", ".join(have), "| cannot import:", " ".join(missing) or "-")')"

# step N NAME MAX_SECONDS COMMAND...: COMMAND under a timeout of at most MAX_SECONDS, cut to the
# budget left; SIGINT first, so pytest still prints the summary of what it ran.
step() {
    local n=$1 name=$2 max=$3
    shift 3
    case " $STEPS " in *" $n "*) ;; *) return 0 ;; esac
    local left=$((BUDGET - (SECONDS - T0)))
    local t=$((max < left ? max : left))
    if [ "$t" -lt 20 ]; then
        log "$n. $name: SKIPPED, ${left}s of the budget left (rerun it: STEPS=\"$n\")"
        failed=$((failed + 1))
        return 0
    fi
    log "$n. $name (timeout ${t}s)"
    local s0=$SECONDS
    timeout -s INT -k 15 "$t" "$@" 2>&1 | tee "$OUT/$n-$name.txt" | tail -n 30
    local status=${PIPESTATUS[0]}
    case $status in
        0) log "$n. $name: passed in $((SECONDS - s0))s" ;;
        124 | 137) log "FAIL: $n. $name: TIMED OUT after ${t}s (partial output: $OUT/$n-$name.txt)"
                   failed=$((failed + 1)) ;;
        *) log "FAIL: $n. $name: exit $status after $((SECONDS - s0))s ($OUT/$n-$name.txt)"
           failed=$((failed + 1)) ;;
    esac
}

# --noconftest: tests/conftest.py needs grpc and uvloop; bench/gpu_pytest_fixtures.py gives the
# kernel tests its one fixture. -v: one line per test as it ends, so a timeout keeps the results.
PYTEST=("$PY" -m pytest -v -rs --durations=10 --noconftest -p bench.gpu_pytest_fixtures
        -p no:cacheprovider -o addopts="")
K=tests/unit/kernels
MULTI_TOKEN="verify_k4 or short_gqa8 or tile_edges"       # test_kernels.py's cases of 2-5 rows

step 1 verify_kernels 120 "${PYTEST[@]}" "$K/test_kernels_verify.py" "$K/test_kernels.py" \
    -k "test_kernels_verify or (($MULTI_TOKEN) and triton)"

step 2 spec_e2e 150 "$PY" -m bench.spec_gpu_check --device cuda

GRAMMAR=()
if ! grep -q "cannot import:.*xgrammar" "$OUT/gpu_check.log"; then
    GRAMMAR=("$K/test_kernels_grammar_mask.py::test_cuda_logits_take_xgrammars_kernel_and_match_the_reference")
fi
# "not cpu": the CPU backend's cases of test_kernels.py run in the CPU suite.
step 3 kernel_tests 150 "${PYTEST[@]}" "$K/test_kernels.py" "$K/test_kernels_cuda.py" ${GRAMMAR[@]+"${GRAMMAR[@]}"} \
    -k "not cpu and not ($MULTI_TOKEN)"

step 4 bench_attention 110 "$PY" -m bench.bench_attention --out "$OUT" --budget 50

step 5 e2e_throughput 120 "$PY" -m bench.e2e_gpu --device cuda

log "done: $failed failed step(s) in $((SECONDS - T0))s; results in $OUT"
exit "$failed"
