"""`python -m kvpage serve DIR`: the flags reach the server (a tiny model saved to a directory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from server_helpers import _free_port, post

ROOT = Path(__file__).resolve().parents[2]


def _wait_healthy(url: str, process, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("kvpage serve did not come up")


def test_serve_flags_reach_the_server(tmp_path, model, tok):
    directory = tmp_path / "tiny"
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "kvpage", "serve", str(directory), "--port", str(port),
                                "--num-kv-blocks", "64", "--max-model-len", "48", "--served-model-name", "t",
                                "--api-key", "k"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        auth = {"Authorization": "Bearer k"}
        request = urllib.request.Request(url + "/v1/models", headers=auth)
        models = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("t", 48)]
        status, body = post(url + "/v1/completions", {"model": "t", "prompt": list(range(5, 55))}, auth)
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = post(url + "/v1/completions", {"model": "t", "prompt": "Hi", "max_tokens": 3}, auth)
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_decode_context_parallel_flags_reach_the_llm(tmp_path, model, tok):
    """The DCP flags are the LLM's arguments: sizes its rules refuse end the command with status 2 and an
    error naming the argument (before any worker starts)."""
    directory = tmp_path / "tiny"
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    for flags, name in ((["--dcp-kv-cache-interleave-size", "3"], "dcp_kv_cache_interleave_size"),
                        (["--decode-context-parallel-size", "2"], "decode_context_parallel_size")):
        done = subprocess.run([sys.executable, "-m", "kvpage", "serve", str(directory), "--port", str(_free_port()),
                               "--num-kv-blocks", "64", *flags], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and name in done.stderr, done.stderr
