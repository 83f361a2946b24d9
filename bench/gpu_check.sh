#!/usr/bin/env bash
# ONE prepared script for a GPU machine (torch with CUDA, nvcc, ninja; no network): builds the
# extension with the CUDA kernels for the GPU it finds, runs the CUDA tests, optionally
# compute-sanitizer, then the GPU benchmark, then the engine phase (tests/gpu: kvpage.LLM and
# PagedCache against HF on the GPU; bench/engine_cuda.py: issue 35's rows); prints a table and
# writes logs + JSON under $OUT (or bench/results/). Built for a single ~8-minute session that must
# return as much information as possible:
#   - every phase has a timeout, cut to what is left of BUDGET (seconds, default 470) so the
#     later phases still get their share; a phase that fails does not stop the next one;
#   - the tests run without -x (--maxfail=30, -rfE lists every failure and error);
#   - the benchmark writes its JSON after every row and records a failing case and goes on.
# Run from the repository root (or anywhere):
#   bash bench/gpu_check.sh            # OUT=/some/dir bash bench/gpu_check.sh
#   SANITIZE=1 bash bench/gpu_check.sh # also compute-sanitizer memcheck + racecheck over every op (~15 s)
#   BENCH_ARGS="--flex --sweep-partitions" bash bench/gpu_check.sh  # benchmark options (default --flex)
#   ENGINE_ARGS="--rows decode_smollm2 --rounds 3" bash bench/gpu_check.sh  # bench/engine_cuda.py options
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PATH="/usr/local/cuda/bin:$PATH"
START=$SECONDS
BUDGET="${BUDGET:-470}"
SANITIZE="${SANITIZE:-0}"
# What the engine phase keeps for itself while the earlier phases run: its tests (~1 min) and at
# least the first rows of bench/engine_cuda.py. On an H200 everything before it took 110 s (run 11).
ENGINE_RESERVE=220
phase() { echo; echo "=== [$((SECONDS - START))s] $*"; }
# Seconds for a phase: its own cap, but never more than what is left of the budget minus what
# the later phases reserve (at least 10).
timeout_for() {
  local cap=$1 reserve=${2:-0} left=$((BUDGET - (SECONDS - START) - ${2:-0}))
  ((left < cap)) && cap=$left
  ((cap < 10)) && cap=10
  echo "$cap"
}
status=0
summary=()
note() { summary+=("$*"); }

phase "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
nvcc --version 2>&1 | tail -1
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'

phase "build (cmake, kernels for this GPU's arch)"
# PREBUILT=path/to/_C*.so: an extension built elsewhere for this machine's torch and Python (see
# bench/prebuild_gpu.sh); used when it imports with CUDA kernels, else build_extension runs.
use_prebuilt() {
  [[ -n "${PREBUILT:-}" && -f "$PREBUILT" ]] || return 1
  cp "$PREBUILT" "$ROOT/python/kvpage/" || return 1  # Python takes the _C of its own ABI tag
  PYTHONPATH="$ROOT/python" "$PY" -c 'from kvpage import ops; assert ops.built_with_cuda'
}

build_extension() {
  local arch prefix build_dir="$ROOT/build/gpu-check" build_timeout
  arch="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")' 2>/dev/null || echo "8.0;9.0")"
  prefix="$("$PY" -c 'import torch, pybind11; print(torch.utils.cmake_prefix_path + ";" + pybind11.get_cmake_dir())')" ||
    { echo "gpu_check: needs torch and pybind11 importable by $PY" >&2; return 1; }
  # A bare toolkit's missing libnvrtc comes from torch's pip package: CMakeLists.txt finds it.
  # The CUDA kernels are split over ~16 files (one per dtype pair), so all cores help.
  build_timeout="$(timeout_for 240 "$((ENGINE_RESERVE + 60))")"
  (
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" timeout 60 cmake -S "$ROOT" -B "$build_dir" -G Ninja \
      -DCMAKE_PREFIX_PATH="$prefix" -DPython_EXECUTABLE="$PY" -DKVPAGE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DKVPAGE_OUTPUT_DIR="$ROOT/python/kvpage" &&
    timeout "$build_timeout" cmake --build "$build_dir" -j "$(nproc)"
  ) >"$RESULTS/gpu_check_build.log" 2>&1
  local rc=$?
  tail -5 "$RESULTS/gpu_check_build.log"
  if [[ $rc -ne 0 ]]; then
    grep -E "error|Error" "$RESULTS/gpu_check_build.log" | head -30
    echo "gpu_check: BUILD FAILED (rc=$rc), see $RESULTS/gpu_check_build.log" >&2
    return 1
  fi
}

if use_prebuilt; then
  echo "using the prebuilt extension $PREBUILT"
  note "build: prebuilt $(basename "$PREBUILT") imported in $((SECONDS - START))s"
else
  [[ -n "${PREBUILT:-}" ]] && echo "prebuilt extension ${PREBUILT} unusable: building"
  build_extension || exit 1
  note "build: ok in $((SECONDS - START))s"
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'from kvpage import ops; assert ops.built_with_cuda; print("kvpage._C built with CUDA")' || exit 1

phase "CUDA tests (every failure listed, up to 30)"
# The later phases took 23 s (benchmark) and 12 s (sanitizers) on an H200 (run 11): reserve about twice
# that, and the engine phase's share.
T="$(timeout_for 180 "$((ENGINE_RESERVE + (SANITIZE == 1 ? 90 : 60)))")"
# The real GPU only: the CPU emulator's runs of the same tests belong to CI, not to device time.
# Parallel workers where pytest-xdist is installed: faster, and a kernel fault that breaks one
# worker's CUDA context ends that worker alone (tests/cuda/cuda_backends.py), which xdist replaces.
PARALLEL=()
"$PY" -c 'import xdist' 2>/dev/null && PARALLEL=(-n "${TEST_WORKERS:-8}" --max-worker-restart 50)
"$PY" -c 'import pytest_timeout' 2>/dev/null && PARALLEL+=(--timeout 120 --timeout-method thread)
KVPAGE_CUDA_TEST_BACKENDS=cuda timeout "$T" "$PY" -m pytest -q -rfE --maxfail=60 -p no:cacheprovider "${PARALLEL[@]}" tests/cuda \
  --junitxml="$RESULTS/gpu_check_tests.xml" 2>&1 | tee "$RESULTS/gpu_check_tests.log" | tail -60
rc=${PIPESTATUS[0]}
if [[ $rc -eq 0 ]]; then
  note "tests/cuda: passed"
else
  [[ $rc -eq 124 ]] && echo "gpu_check: CUDA tests TIMED OUT after ${T}s" >&2
  echo "gpu_check: CUDA TESTS FAILED (rc=$rc)" >&2
  note "tests/cuda: FAILED rc=$rc ($(grep -cE '^(FAILED|ERROR) ' "$RESULTS/gpu_check_tests.log") failed/errored listed)"
  status=1
fi
if [[ -d tests/ops ]]; then
  # The CPU op tests, for whatever they parametrise over CUDA (ids containing "cuda").
  timeout "$(timeout_for 60 "$((ENGINE_RESERVE + 60))")" "$PY" -m pytest -q -rfE -p no:cacheprovider tests/ops -k cuda 2>&1 | tail -8
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 || $rc -eq 5 ]] || { echo "gpu_check: tests/ops -k cuda FAILED" >&2; note "tests/ops -k cuda: FAILED rc=$rc"; status=1; }
fi
# Decode steps replayed from a CUDA graph give the eager step's hidden states (kvpage.model.cuda_graphs).
timeout "$(timeout_for 60 "$((ENGINE_RESERVE + 60))")" "$PY" -m pytest -q -rfE -p no:cacheprovider tests/model/test_cuda_graphs.py 2>&1 | tail -8
rc=${PIPESTATUS[0]}
[[ $rc -eq 0 ]] || { echo "gpu_check: CUDA graph tests FAILED" >&2; note "tests/model/test_cuda_graphs.py: FAILED rc=$rc"; status=1; }

phase "GPU benchmark (JSON rewritten after every row: $RESULTS/kernels_cuda.json)"
T="$(timeout_for 240 "$((ENGINE_RESERVE + (SANITIZE == 1 ? 30 : 0)))")"
timeout "$T" "$PY" bench/kernels_cuda.py ${BENCH_ARGS:---flex} --out "$RESULTS/kernels_cuda.json" 2>&1 |
  tee "$RESULTS/gpu_check_bench.log"
rc=${PIPESTATUS[0]}
if [[ $rc -eq 0 ]]; then
  note "benchmark: complete"
else
  [[ $rc -eq 124 ]] && echo "gpu_check: benchmark TIMED OUT after ${T}s; the JSON holds the rows done" >&2
  echo "gpu_check: BENCHMARK FAILED or incomplete (rc=$rc)" >&2
  note "benchmark: rc=$rc ($("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(len(r["rows"]), "rows,", sum("error" in x for x in r["rows"]), "with errors")' "$RESULTS/kernels_cuda.json" 2>/dev/null || echo "no JSON"))"
  status=1
fi

if [[ "$SANITIZE" == "1" ]]; then
  phase "compute-sanitizer memcheck and racecheck (every op once, range checks off, bad indices)"
  SAN="$(command -v compute-sanitizer || true)"
  for cand in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [[ -z "$SAN" && -x "$cand" ]] && SAN="$cand"
  done
  if [[ -z "$SAN" ]]; then
    echo "gpu_check: compute-sanitizer not found; skipped"
    note "sanitize: SKIPPED (no compute-sanitizer)"
  else
    # memcheck: out-of-bounds and misaligned accesses (no caching allocator: each tensor its own
    # allocation, so an access just past one is caught); racecheck: shared-memory hazards (the
    # decode ring, the prefill tiles).
    for tool in memcheck racecheck; do
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(timeout_for "${SANITIZE_TIMEOUT:-150}" "$ENGINE_RESERVE")" \
        "$SAN" --tool "$tool" --error-exitcode 99 --print-limit 20 \
        "$PY" tests/cuda/sanitize_ops.py >"$RESULTS/gpu_check_$tool.log" 2>&1
      rc=$?
      tail -4 "$RESULTS/gpu_check_$tool.log"
      case $rc in
        0) note "$tool: clean" ;;
        99) echo "gpu_check: compute-sanitizer $tool found ERRORS" >&2; note "$tool: ERRORS"; status=1 ;;
        124) echo "gpu_check: compute-sanitizer $tool TIMED OUT" >&2; note "$tool: TIMED OUT (see its log)"; status=1 ;;
        *) echo "gpu_check: $tool run FAILED (rc=$rc)" >&2; note "$tool: FAILED rc=$rc"; status=1 ;;
      esac
    done
  fi
fi

phase "engine tests: kvpage.LLM and PagedCache against HF on the GPU (tests/gpu, CUDA cases)"
# The CPU cases of the same tests are CI's; "not cpu" keeps the GPU's.
timeout "$(timeout_for 120 160)" "$PY" -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "not cpu" \
  --junitxml="$RESULTS/gpu_check_engine_tests.xml" 2>&1 | tee "$RESULTS/gpu_check_engine_tests.log" | tail -30
rc=${PIPESTATUS[0]}
if [[ $rc -eq 0 ]]; then
  note "tests/gpu: passed"
else
  [[ $rc -eq 124 ]] && echo "gpu_check: engine tests TIMED OUT" >&2
  note "tests/gpu: FAILED rc=$rc ($(grep -cE '^(FAILED|ERROR) ' "$RESULTS/gpu_check_engine_tests.log") failed/errored listed)"
  status=1
fi

phase "engine benchmark (JSON rewritten after every row: $RESULTS/engine_cuda.json)"
# The script time-boxes its rows inside --budget, so it ends (and writes its JSON) before the timeout.
T="$(timeout_for 330 0)"
timeout "$T" "$PY" bench/engine_cuda.py --budget "$((T - 15))" ${ENGINE_ARGS:-} --out "$RESULTS/engine_cuda.json" 2>&1 |
  tee "$RESULTS/gpu_check_engine_bench.log" | grep -v "ContinuousBatchingLogger"
rc=${PIPESTATUS[0]}
if [[ $rc -eq 0 ]]; then
  note "engine benchmark: complete"
else
  note "engine benchmark: rc=$rc ($("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(len(r["rows"]), "rows,", sum("error" in x for x in r["rows"]), "with errors")' "$RESULTS/engine_cuda.json" 2>/dev/null || echo "no JSON"))"
  status=1
fi
"$PY" - "$RESULTS/engine_cuda.json" <<'PYEOF' 2>/dev/null
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    figure = f"ratio {row['ratio']:.2f} (target {row['target']})" if "ratio" in row else f"ERROR {row.get('error')}"
    print(f"  {row['row']:16} {figure}")
PYEOF

phase "done (status $status)"
printf '  %s\n' "${summary[@]}"
exit $status
