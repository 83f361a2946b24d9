#!/usr/bin/env bash
# Compile-checks every CUDA kernel file with the local nvcc for sm_80 and sm_90 (no GPU needed),
# as C++17 with every nvcc warning an error, and prints registers / spills per kernel
# (-Xptxas -v). Fails on any error.
#
#   .ci/cuda_check.sh            kernels only, each file on its own (no torch; ~2 min on 2 cores)
#   .ci/cuda_check.sh --build    the same checks inside a build of the real extension against a
#                                CUDA torch, in a scratch copy of the tree (each .cu compiles once),
#                                then check every op registers a CUDA kernel
#                                (KVPAGE_CI_CUDA_BUILD=1 does the same; creates the venv if missing)
#
# Env: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), CUDA_ARCHS (default "80 90"),
# KVPAGE_CUDA_VENV (default /work/cuda-venv), KVPAGE_CUDA_TORCH (default torch==2.14.1).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# The toolkit's own nvcc (CUDA_HOME, /usr/local/cuda), so CMake derives the toolkit dir from it;
# a wrapper on PATH (e.g. /usr/local/bin/nvcc) is only the last resort.
NVCC="${NVCC:-}"
for cand in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
  [[ -z "$NVCC" && -n "$cand" && -x "$cand" ]] && NVCC="$cand"
done
ARCHS="${CUDA_ARCHS:-80 90}"
BUILD="${KVPAGE_CI_CUDA_BUILD:-0}"
[[ "${1:-}" == "--build" ]] && BUILD=1
CHECK_FLAGS="-Xptxas -v -Werror all-warnings"
JOBS="${JOBS:-$(nproc)}"

if [[ ! -x "$NVCC" ]]; then
  echo "cuda_check: nvcc not found ($NVCC); set NVCC" >&2
  exit 1
fi
echo "cuda_check: $("$NVCC" --version | tail -1)"
LOG="$(mktemp -d)"
SCRATCH=""
trap 'rm -rf "$LOG" $SCRATCH' EXIT

# Each .cu alone, once per arch, at most JOBS at a time (so a file's wall time is its own compile
# time, not a share of an oversubscribed machine). Logs: $LOG/<file>.sm_<arch>.log and .time.
compile_each_file() {
  for src in "$ROOT"/csrc/cuda/*.cu; do
    for arch in $ARCHS; do
      while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
      out="$LOG/$(basename "$src" .cu).sm_$arch.log"
      ( start=$EPOCHREALTIME
        # shellcheck disable=SC2086
        "$NVCC" -std=c++17 -O3 -arch="sm_$arch" $CHECK_FLAGS -c "$src" -o /dev/null >"$out" 2>&1 ||
          echo "FAILED" >>"$out"
        echo "$(basename "$src") sm_$arch $start $EPOCHREALTIME" >"$out.time" ) &
    done
  done
  wait
  local failed=0
  for out in "$LOG"/*.log; do
    if grep -q "^FAILED" "$out" || grep -qi "error" "$out"; then
      echo "cuda_check: $(basename "$out" .log) FAILED" >&2
      grep -v "ptxas info" "$out" >&2 || true
      failed=1
    fi
  done
  return $failed
}

# Registers / spills per kernel from nvcc logs: "Compiling entry function 'X' for 'sm_N'" comes
# before that kernel's spill and "Used N registers" lines (ninja prints each command's output
# whole, so a build log reads the same way).
report_registers() {
  python3 - "$@" <<'PYEOF'
import re, subprocess, sys
rows = set()
for path in sys.argv[1:]:
    fn = arch = spill = None
    for line in open(path):
        if m := re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line):
            fn, arch, spill = m[1], m[2], "?"
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = f"{m[1]}/{m[2]}"
        elif (m := re.search(r"Used (\d+) registers", line)) and fn:
            rows.add((arch, fn, int(m[1]), spill))
            fn = None
if not rows:
    sys.exit("cuda_check: no register report found in the nvcc output (-Xptxas -v missing?)")
names = sorted({r[1] for r in rows})
try:
    pretty = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
except OSError:
    pretty = names
short = {}
for raw, nice in zip(names, pretty):
    nice = re.sub(r"kvpage::cuda::|\(anonymous namespace\)::|__nv_|__", "", nice)
    short[raw] = re.sub(r"\(.*\)$", "", nice)  # drop the parameter list
print(f"{'arch':7} {'kernel':58} {'regs':>5} {'spill st/ld':>12}")
for arch, name, regs, spill in sorted({(a, short[f], r, s) for a, f, r, s in rows}):
    print(f"{arch:7} {name[:58]:58} {regs:5d} {spill:>12}")
PYEOF
  local spills
  spills="$(grep -h "bytes spill stores" "$@" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)"
  echo "cuda_check: kernels with spills: $spills"
}

if [[ "$BUILD" != "1" ]]; then
  status=0
  compile_each_file || status=1
  echo
  report_registers "$LOG"/*.log
  echo
  echo "compile seconds per file and arch ($JOBS at a time):"
  sort "$LOG"/*.time | awk '{printf "  %-36s %-6s %6.1f\n", $1, $2, $4 - $3}'
  [[ $status -ne 0 ]] && { echo "cuda_check: nvcc compile check FAILED" >&2; exit 1; }
  echo "cuda_check: all kernel files compile for sm_${ARCHS// /, sm_}"
  exit 0
fi

# ---- The real extension against a CUDA torch, in a scratch copy (never touches the tree's _C) ----
VENV="${KVPAGE_CUDA_VENV:-/work/cuda-venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "${KVPAGE_CUDA_TORCH:-torch==2.14.1}" pybind11 ninja cmake numpy pytest
fi
PY="$VENV/bin/python"
SCRATCH="$(mktemp -d /tmp/kvpage-cuda-build.XXXX)"
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} "$SCRATCH"/) 2>/dev/null ||
  (cd "$ROOT" && tar --exclude=./build --exclude='*.so' --exclude=./.git -cf - . | tar -xf - -C "$SCRATCH")
export PATH="$(dirname "$NVCC"):$VENV/bin:$PATH"
PREFIX="$("$PY" -c 'import torch,pybind11;print(torch.utils.cmake_prefix_path+";"+pybind11.get_cmake_dir())')"
# A bare toolkit has no libnvrtc: CMakeLists.txt takes the one of torch's pip package.
ARCH_LIST="$(for a in $ARCHS; do printf '%s.%s;' "${a:0:-1}" "${a: -1}"; done)"
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-${ARCH_LIST%;}}" cmake -S "$SCRATCH" -B "$SCRATCH/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DPython_EXECUTABLE="$PY" -DKVPAGE_CUDA=ON -DCMAKE_CUDA_FLAGS="$CHECK_FLAGS" \
  -DKVPAGE_OUTPUT_DIR="$SCRATCH/python/kvpage" >"$LOG/configure.txt" 2>&1 ||
  { cat "$LOG/configure.txt" >&2; exit 1; }
cmake --build "$SCRATCH/build" -j "${MAX_JOBS:-$JOBS}" >"$LOG/build.txt" 2>&1 ||
  { grep -v "ptxas info" "$LOG/build.txt" | tail -60 >&2; echo "cuda_check: extension build FAILED" >&2; exit 1; }
if grep -i "warning" "$LOG/build.txt" | grep -q "csrc/cuda/.*\.cu"; then
  grep -i "warning" "$LOG/build.txt" | grep "csrc/cuda/.*\.cu" >&2; echo "cuda_check: nvcc warnings" >&2; exit 1
fi
echo
report_registers "$LOG/build.txt"
echo
echo "compile seconds per kernel file, all archs in one nvcc call ($JOBS at a time):"
awk '!/^#/ && $4 ~ /\.cu\.o$/ {n = split($4, p, "/"); printf "  %-36s %6.1f\n", p[n], ($2 - $1) / 1000}' \
  "$SCRATCH/build/.ninja_log" | sort
echo "cuda_check: all kernel files compile for sm_${ARCHS// /, sm_}"
# Launchers defined in one .cu and called from another (attention_decode.h) must all link: a
# shared library may carry undefined symbols until the first call, so check them here.
undefined="$(nm -C -D --undefined-only "$SCRATCH"/python/kvpage/_C*.so | grep "kvpage::" || true)"
[[ -z "$undefined" ]] || { echo "$undefined" >&2; echo "cuda_check: undefined kvpage symbols in _C" >&2; exit 1; }
PYTHONPATH="$SCRATCH/python" "$PY" - <<'PYEOF'
import torch
from kvpage import _C, ops  # noqa: F401
assert _C.built_with_cuda, "kvpage._C built without CUDA"
missing = [op for op in ("reshape_and_cache", "paged_attention", "paged_prefill_attention", "copy_blocks",
                         "swap_blocks")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kvpage::{op}", "CUDA")]
assert not missing, f"no CUDA kernel registered for {missing}"
print(f"cuda_check: extension builds against torch {torch.__version__} and registers every op for CUDA")
PYEOF
