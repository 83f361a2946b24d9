"""`python -m kvpage serve DIR`: the flags reach the server (a tiny model saved to a directory)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from server_helpers import _free_port, post, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


def test_serve_flags_reach_the_server(tmp_path, model, tok):
    directory = tmp_path / "tiny"
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "kvpage", "serve", str(directory), "--port", str(port),
                                "--num-kv-blocks", "64", "--max-model-len", "48", "--served-model-name", "t",
                                "--api-key", "k", "--metrics-without-auth", "--max-request-body-bytes", "2000"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=90.0)
        auth = {"Authorization": "Bearer k"}
        request = urllib.request.Request(url + "/v1/models", headers=auth)
        models = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("t", 48)]
        status, body = post(url + "/v1/completions", {"model": "t", "prompt": list(range(5, 55))}, auth)
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = post(url + "/v1/completions", {"model": "t", "prompt": "Hi", "max_tokens": 3}, auth)
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
        status, body = post(url + "/v1/completions", {"model": "t", "prompt": "Hi " * 1000}, auth)
        assert status == 413 and "2000" in body["error"]["message"]
        assert post(url + "/tokenize", {"prompt": "Hi"})[0] == 401  # every route but /health needs the key ...
        assert urllib.request.urlopen(url + "/metrics", timeout=10).status == 200  # ... /metrics: the flag
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


def _serve(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvpage", "serve", *flags], env=env, capture_output=True, text=True,
                          timeout=120)


def test_serve_checks_its_flags_before_anything_loads():
    """--port 99999 loaded the model and then died with uvicorn's OverflowError traceback."""
    for flags, message in ((["--port", "99999"], "argument --port: must be a TCP port in [1, 65535], got 99999"),
                           (["--port", "0"], "argument --port"), (["--api-key", ""], "argument --api-key"),
                           (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes")):
        done = _serve("/no/such/model", *flags)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_serve_binds_its_port_before_loading_the_model():
    """A busy port is one line, before the model loads: the model directory here does not even exist, and
    it is the port the error is about."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _serve("/no/such/model", "--port", str(port))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"kvpage serve: error: cannot listen on 127.0.0.1:{port}:"
                                                " Address already in use"]
