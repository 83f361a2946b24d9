"""Runs vLLM's CPU backend in its own venv and process, on the same model and workload: the offline engine
(bench/peers/vllm_peer.py, VllmPeer) or its OpenAI-compatible server (`vllm serve`, serve_argv).

vLLM stays out of kvpage's dependencies and out of CI: it lives in $KVPAGE_VLLM_VENV (default
~/.cache/kvpage/vllm-venv, made by bench/peers/setup_vllm.sh), and this module only starts a subprocess.
The peer stays up between timed runs (VllmPeer.run), so a benchmark can alternate vLLM's runs with
kvpage's and compare each pair at the same moment: this machine's speed drifts by +-15% over minutes.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

PEER_SCRIPT = Path(__file__).resolve().parent / "vllm_peer.py"
DONE_MARKER = "KVPAGE_PEER_RESULT "  # vllm_peer.py's reply prefix (vLLM logs on the same stdout)
# vLLM's CPU attention takes block sizes that are multiples of 32.
VLLM_BLOCK_SIZE = 32


def vllm_python() -> Path:
    venv = Path(os.environ.get("KVPAGE_VLLM_VENV", Path.home() / ".cache" / "kvpage" / "vllm-venv"))
    return venv / "bin" / "python"


def available() -> bool:
    return vllm_python().is_file()


def vllm_env(kv_cache_gib: float, threads: int) -> dict:
    """The environment both vLLM peers run in: offline (no hub), kvpage's KV-cache budget (vLLM's CPU
    backend takes whole GiB), and its OpenMP threads bound to the cores kvpage's threads use."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}


def serve_argv(model_dir: str, port: int, served_model_name: str, enable_prefix_caching: bool = True,
               max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, dtype: str = "float32") -> list[str]:
    """`vllm serve` on 127.0.0.1:port with VllmPeer's engine settings (run it in vllm_env's environment).
    Its `vllm` command needs the `vllm` distribution stub that bench/peers/setup_vllm.sh writes."""
    caching = "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching"
    return [str(vllm_python().parent / "vllm"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--dtype", dtype, "--block-size", str(VLLM_BLOCK_SIZE),
            caching, "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--seed", "0"]


class VllmPeer:
    """One vLLM engine in its own process: warmed up on start, then one timed run per run() call."""

    def __init__(self, model_dir: str, warmup_prompts: list[list[int]], output_lens: list[int],
                 enable_prefix_caching: bool, kv_cache_gib: float, threads: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, dtype: str = "float32") -> None:
        if not available():
            raise RuntimeError(f"no vLLM venv at {vllm_python().parent.parent}: run bash bench/peers/setup_vllm.sh")
        self._tmp = tempfile.TemporaryDirectory()
        spec = {"model": model_dir, "warmup_prompts": warmup_prompts, "output_lens": output_lens,
                "enable_prefix_caching": enable_prefix_caching, "block_size": VLLM_BLOCK_SIZE,
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "dtype": dtype}
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = vllm_env(kv_cache_gib, threads)
        self._stderr = open(Path(self._tmp.name) / "stderr.txt", "w+")
        self._proc = subprocess.Popen([str(vllm_python()), str(PEER_SCRIPT), str(spec_path)], env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._runs = 0
        self._reply()  # start-up and warm-up done

    def run(self, prompts: list[list[int]]) -> dict:
        path = Path(self._tmp.name) / f"prompts{self._runs}.json"
        path.write_text(json.dumps(prompts))
        self._runs += 1
        self._proc.stdin.write(f"{path}\n")
        self._proc.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        for line in self._proc.stdout:
            if line.startswith(DONE_MARKER):
                return json.loads(line[len(DONE_MARKER):])
        self._stderr.seek(0)
        raise RuntimeError(f"vLLM peer exited ({self._proc.wait()}): {self._stderr.read()[-2000:]}")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._stderr.close()
        self._tmp.cleanup()

    def __enter__(self) -> "VllmPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
