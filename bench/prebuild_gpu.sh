#!/usr/bin/env bash
# Builds kvpage._C here (no GPU needed) for the lent GPU machine's software, so a device lease
# spends no time compiling: torch 2.11.0+cu130 under Python 3.12, kernels for sm_90 (H100/H200).
# bench/gpu_check.sh takes the result with PREBUILT=.prebuilt/<name>.so and falls back to its own
# build if it does not import there.
#
#   bash bench/prebuild_gpu.sh          # -> .prebuilt/_C.cpython-312-x86_64-linux-gnu.so
#
# Env: KVPAGE_GPU_VENV (default /work/venv312: python3.12 -m venv, then pip install the torch
# 2.11.0 cp312 wheel (with its nvidia-* dependencies: ATen's CUDA headers need cusparse.h and
# friends), pybind11, cmake, ninja); TORCH_CUDA_ARCH_LIST (default 9.0). .prebuilt/ is a build
# output: keep it out of git (.git/info/exclude) and name it in the device tool's carry.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVPAGE_GPU_VENV:-/work/venv312}"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || { echo "prebuild_gpu: no venv at $VENV (see the header of $0)" >&2; exit 1; }
export PATH="/usr/local/cuda/bin:$VENV/bin:$PATH"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# cmake must not import torch (its CUDA libraries need not load here): paths from the files. libnvrtc,
# which the bare toolkit lacks, CMakeLists.txt takes from torch's pip package (site-packages/nvidia).
PREFIX="$SITE/torch/share/cmake;$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')"
BUILD="$ROOT/build/prebuild-gpu"
OUTDIR="$ROOT/build/prebuild-gpu-out"
mkdir -p "$OUTDIR" "$ROOT/.prebuilt"
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" cmake -S "$ROOT" -B "$BUILD" -G Ninja \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DPython_EXECUTABLE="$PY" -DKVPAGE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_FLAGS="-Xptxas -v" -DKVPAGE_OUTPUT_DIR="$OUTDIR" >"$BUILD.configure.log" 2>&1 ||
  { tail -40 "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" >"$BUILD.log" 2>&1 || { grep -v "ptxas info" "$BUILD.log" | tail -60 >&2; exit 1; }
rm -f "$ROOT"/.prebuilt/_C*.so
cp "$OUTDIR"/_C*.so "$ROOT/.prebuilt/"
ls -la "$ROOT"/.prebuilt/_C*.so
echo "prebuild_gpu: build log with the sm_90 register report: $BUILD.log"
