"""A tiny random Llama over the default model's tokenizer, and a uvicorn server in a background thread."""
from __future__ import annotations

import copy
import socket
import threading
import time
from contextlib import contextmanager

import torch
import uvicorn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import kvpage
from kvpage.model.loader import default_model_dir
from kvpage.server import build_app

MODEL_NAME = "tiny-llama"


def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def tiny_llama(vocab_size: int, seed: int = 0):
    """A random fp32 Llama over the tokenizer's vocabulary; a non-trivial init scale, so greedy text varies."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def make_llm(model, tok, **kwargs) -> kvpage.LLM:
    """An engine over its own copy of the weights (the runner converts its model in place)."""
    kwargs.setdefault("num_kv_blocks", 512)
    return kvpage.LLM(model=copy.deepcopy(model), tokenizer=tok, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(llm, **app_kwargs):
    """The app on 127.0.0.1:<free port> in a thread; yields its base URL, stops it on exit."""
    app = build_app(llm, MODEL_NAME, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a POST; body: bytes as they are, anything else as JSON."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_healthy(url: str, process, timeout: float = 180.0) -> None:
    """Wait for a `kvpage serve` subprocess (stdout piped, text) to answer GET /health; its output is the
    assertion's message if it exits first."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("kvpage serve did not come up")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name: value} (one model, so labels are dropped)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels and "finished_reason" not in s.labels}


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits: aborts reach the engine loop between its steps."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        idle = not metrics["kvpage:num_requests_running"] and not metrics["kvpage:num_requests_waiting"]
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def get_status(url: str, path: str) -> int:
    """The HTTP status of a GET."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url + path, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def stream_lines(url: str, body: dict, first_read, lines: list, keep_reading: bool = True) -> None:
    """POST a streamed completion and collect its SSE payloads into lines (first_read set at the first);
    keep_reading=False closes the connection after the first (a client that went away)."""
    import json
    import urllib.request
    request = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data: "):
                lines.append(line[6:].strip().decode())
                first_read.set()
                if not keep_reading:
                    return
