#!/usr/bin/env bash
# ONE prepared script for a GPU machine (torch with CUDA, nvcc, ninja; no network): builds the
# extension with the CUDA kernels for the GPU it finds, runs the CUDA tests, then the GPU
# benchmark; prints a table and writes logs + JSON under $OUT (or bench/results/) . Stays within
# ~8 minutes: every phase has its own timeout. Run from the repository root (or anywhere):
#   bash bench/gpu_check.sh            # OUT=/some/dir bash bench/gpu_check.sh
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/results}"
mkdir -p "$RESULTS"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PATH="/usr/local/cuda/bin:$PATH"
START=$SECONDS
phase() { echo; echo "=== [$((SECONDS - START))s] $*"; }
status=0

phase "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
nvcc --version 2>&1 | tail -1
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'

phase "build (cmake, kernels for this GPU's arch)"
ARCH="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")' 2>/dev/null || echo "8.0;9.0")"
PREFIX="$("$PY" -c 'import torch, pybind11; print(torch.utils.cmake_prefix_path + ";" + pybind11.get_cmake_dir())')" ||
  { echo "gpu_check: needs torch and pybind11 importable by $PY" >&2; exit 1; }
EXTRA=()
if ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1; then  # bare toolkit: torch's pip nvrtc
  NVRTC="$("$PY" -c 'import glob,nvidia,os;print(next(iter(sorted(glob.glob(os.path.join(nvidia.__path__[0],"*","lib","libnvrtc.so*")))),""))' 2>/dev/null || true)"
  [[ -n "$NVRTC" ]] && EXTRA+=("-DCUDA_nvrtc_LIBRARY=$NVRTC" "-DCUDA_NVRTC_LIB=$NVRTC")
fi
BUILD_DIR="$ROOT/build/gpu-check"
(
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$ARCH}" timeout 60 cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DPython_EXECUTABLE="$PY" -DKVPAGE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DKVPAGE_OUTPUT_DIR="$ROOT/python/kvpage" "${EXTRA[@]}" &&
  timeout 200 cmake --build "$BUILD_DIR" -j "$(nproc)"
) >"$RESULTS/gpu_check_build.log" 2>&1
rc=$?
tail -5 "$RESULTS/gpu_check_build.log"
if [[ $rc -ne 0 ]]; then
  grep -E "error|Error" "$RESULTS/gpu_check_build.log" | head -30
  echo "gpu_check: BUILD FAILED (rc=$rc), see $RESULTS/gpu_check_build.log" >&2
  exit 1
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'from kvpage import ops; assert ops.built_with_cuda; print("kvpage._C built with CUDA")' || exit 1

phase "CUDA tests"
timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/cuda --junitxml="$RESULTS/gpu_check_tests.xml" \
  2>&1 | tee "$RESULTS/gpu_check_tests.log" | tail -25
[[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "gpu_check: CUDA TESTS FAILED" >&2; status=1; }
if [[ -d tests/ops ]]; then
  # The CPU op tests, for whatever they parametrise over CUDA (ids containing "cuda").
  timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/ops -k cuda 2>&1 | tail -5
  rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 || $rc -eq 5 ]] || { echo "gpu_check: tests/ops -k cuda FAILED" >&2; status=1; }
fi

phase "GPU benchmark"
timeout 200 "$PY" bench/kernels_cuda.py --flex --out "$RESULTS/kernels_cuda.json" 2>&1 |
  tee "$RESULTS/gpu_check_bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "gpu_check: BENCHMARK FAILED or timed out" >&2; status=1; }

phase "done (status $status)"
exit $status
