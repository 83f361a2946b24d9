"""The servers bench/serve.py (and bench/multiturn.py, serve_attack.py, llamacpp.py) measure, each in its own
process: started on a free port and polled on /health (`kvpage serve`, vLLM's `vllm serve` with VllmPeer's
settings), stopped, and their CPU seconds (the server's process and every process below it) read from /proc.
Also the tiny random model the --quick runs serve.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Imported for its side effect: kvpage sets its GOMP_SPINCOUNT default in os.environ, so every server started
# here (vllm serve too) inherits the OpenMP spin the engine core kvpage starts runs with.
import kvpage  # noqa: F401
from peers import vllm_launcher

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench"


def tiny_model_dir(directory: Path) -> Path:
    """A random 2-layer Llama over the default model's tokenizer, saved as an HF directory (--quick)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvpage.model.loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One OpenAI-compatible server in its own process; its output goes to `log` (shown if it fails)."""
    name: str
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_server(name: str, argv, env: dict, log_dir: Path, timeout_s: float = 600) -> Server:
    """argv(port) started and polled on /health until it answers."""
    port = _free_port()
    log = log_dir / f"{name.replace(' ', '_')}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(argv(port), env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(name, process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}) while starting: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(server.url + "/health", timeout=2)
            return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{name} did not come up in {timeout_s:.0f} s: {log.read_text()[-2000:]}")


KVPAGE = "kvpage serve"
# --engine-core: where `kvpage serve` runs its engine core; the process core is the report's "kvpage serve".
SERVER_NAMES = {"process": KVPAGE, "inprocess": "kvpage serve in-process core"}


def start_kvpage(model_dir: Path, log_dir: Path, engine_core: str = "process", swap_space_gib: float | None = None,
                 num_kv_blocks: int | None = None, max_num_batched_tokens: int | None = None) -> Server:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    swap = [] if swap_space_gib is None else ["--swap-space-gib", str(swap_space_gib)]
    swap += [] if num_kv_blocks is None else ["--num-kv-blocks", str(num_kv_blocks)]
    swap += [] if max_num_batched_tokens is None else ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return start_server(SERVER_NAMES[engine_core],
                        lambda port: [sys.executable, "-m", "kvpage", "serve", str(model_dir), "--port", str(port),
                                      "--served-model-name", MODEL_NAME, "--engine-core", engine_core, *swap],
                        env, log_dir)


def start_vllm(model_dir: Path, log_dir: Path, kv_cache_gib: float,
               max_num_batched_tokens: int | None = None) -> Server:
    """`vllm serve` with bench/engine.py's VllmPeer settings (kvpage.LLM's defaults, float32)."""
    import torch

    env = vllm_launcher.vllm_env(kv_cache_gib, torch.get_num_threads())
    budget = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    return start_server("vllm serve", lambda port: vllm_launcher.serve_argv(str(model_dir), port, MODEL_NAME, **budget),
                        env, log_dir)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc; 0 where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids


def _descendants(pid: int) -> list[int]:
    """Children, grandchildren and so on: vLLM's model runs in a worker process that its engine core spawned."""
    kids = _children(pid)
    return kids + [d for k in kids for d in _descendants(k)]


def server_cpu(server: Server) -> dict:
    """CPU seconds so far of the server's process and of every process below it (kvpage's engine core; vLLM's
    engine core and the worker it spawned, which runs the model): where a run's time goes between HTTP and the
    engine. Linux only (empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    pid = server.process.pid
    return {"server_process": _cpu_seconds(pid), "child_processes": sum(_cpu_seconds(k) for k in _descendants(pid))}
