"""Runs bench/peers/vllm_peer.py in vLLM's own venv and process, on the same model and workload.

vLLM stays out of kvpage's dependencies and out of CI: it lives in $KVPAGE_VLLM_VENV (default
~/.cache/kvpage/vllm-venv, made by bench/peers/setup_vllm.sh), and this module only starts a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

PEER_SCRIPT = Path(__file__).resolve().parent / "vllm_peer.py"
# vLLM's CPU attention takes block sizes that are multiples of 32.
VLLM_BLOCK_SIZE = 32


def vllm_python() -> Path:
    venv = Path(os.environ.get("KVPAGE_VLLM_VENV", Path.home() / ".cache" / "kvpage" / "vllm-venv"))
    return venv / "bin" / "python"


def available() -> bool:
    return vllm_python().is_file()


def run_vllm(model_dir: str, prompts: list[list[int]], warmup_prompts: list[list[int]], output_lens: list[int],
             enable_prefix_caching: bool, kv_cache_gib: float, threads: int, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, timeout_s: float = 1800) -> dict:
    """One vLLM engine: a warm-up pass, then the timed pass; returns its result dict (or raises)."""
    if not available():
        raise RuntimeError(f"no vLLM venv at {vllm_python().parent.parent}: run bash bench/peers/setup_vllm.sh")
    spec = {"model": model_dir, "prompts": prompts, "warmup_prompts": warmup_prompts, "output_lens": output_lens,
            "enable_prefix_caching": enable_prefix_caching, "block_size": VLLM_BLOCK_SIZE,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(vllm_python()), str(PEER_SCRIPT), str(spec_path), str(result_path)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM peer failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(result_path.read_text())
