"""`kvpage serve --speculative-config '{...}'`: the flag reaches the engine, greedy completions are the offline
engine's without speculation, and /metrics exports the acceptance counters (vLLM's spec_decode names)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kvpage
from kvpage import SamplingParams

from spec_helpers import NGRAM, PROMPTS

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def _wait_healthy(url: str, process, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("kvpage serve did not come up")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_serve_with_speculation(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=32)
    offline = kvpage.LLM(model=tiny_dir, num_kv_blocks=128, block_size=4, swap_space_gib=0)
    expected = [out.outputs[0].text for out in offline.generate(PROMPTS, params, use_tqdm=False)]
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "kvpage", "serve", tiny_dir, "--port", str(port),
                                "--num-kv-blocks", "128", "--block-size", "4", "--swap-space-gib", "0",
                                "--served-model-name", "t", "--speculative-config", json.dumps(NGRAM)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        got = [_post(url + "/v1/completions", {"model": "t", "prompt": p, "max_tokens": 32, "temperature": 0})
               ["choices"][0]["text"] for p in PROMPTS]
        assert got == expected
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert _metric(metrics, "kvpage:spec_decode_num_drafts_total") > 0
        draft = _metric(metrics, "kvpage:spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "kvpage:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= draft
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serve_refuses_a_bad_config_naming_the_key(tiny_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvpage", "serve", tiny_dir, "--port", str(_free_port()),
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "num_speculative_tokens" in done.stderr, done.stderr
