"""The server over an engine core in a process of its own (`kvpage serve --engine-core process`, the default):
the same answers as offline generation, refusals and max_tokens fitting across the boundary, aborts that free
blocks in the core, metrics that move, no CPU while idle, and a core killed with SIGKILL reported as 503 to
every stream in flight and to every later request, never a hang."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from kvpage import SamplingParams
from kvpage.engine.core_client import MPEngineCoreClient
from kvpage.engine.core_process import decode_outputs, encode_outputs
from kvpage.engine.outputs import CompletionOutput, Logprob, RequestOutput
from server_helpers import MODEL_NAME, get_status, post, running_server, scrape, stream_lines, wait_idle

IDLE_CPU_LIMIT = 0.02  # of one core


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model, tok):
    directory = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def _core(model_dir: str) -> MPEngineCoreClient:
    return MPEngineCoreClient(model_dir, {"num_kv_blocks": 128, "max_model_len": 256}, start_timeout=300)


@pytest.fixture(scope="module")
def process_server(model_dir):
    """(base URL, app, client) of a server whose engine core runs in its own process."""
    client = _core(model_dir)
    try:
        with running_server(client) as (url, app):
            yield url, app, client
    finally:
        client.shutdown()


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (every thread of it)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _outputs(num_tokens: int, finished: bool, rid: str = "r") -> RequestOutput:
    """Request rid's cumulative output after num_tokens tokens: two samples, logprobs, prompt logprobs."""
    samples = [CompletionOutput(i, "ab"[i] * num_tokens, list(range(10 * i, 10 * i + num_tokens)),
                                "length" if finished else None, -0.5 * num_tokens,
                                [{t: Logprob(-0.5, 1, "x")} for t in range(num_tokens)]) for i in range(2)]
    return RequestOutput(rid, "hi", [5, 7, 9], samples, finished, {"ttft": 0.1},
                         [None, {7: Logprob(-1.0, 2)}, {9: Logprob(-2.0, 1)}], 0)


def test_outputs_cross_the_pipe_unchanged():
    """encode_outputs / decode_outputs: every field back, the prompt's ids sent with the first and final
    outputs only; an aborted request's late output neither fails nor stays recorded."""
    prompts = {"r": None}
    for num_tokens, finished in ((1, False), (2, False), (3, False), (4, True)):
        sent = _outputs(num_tokens, finished)
        rows = encode_outputs([sent])
        assert (rows[0][2] is None) == (1 < num_tokens < 4)
        assert decode_outputs(rows, prompts) == [sent]
    assert prompts == {}  # forgotten at the final output
    late = decode_outputs(encode_outputs([_outputs(5, False, "gone")]), prompts)
    assert late[0].prompt_token_ids is None and prompts == {}


def test_greedy_answers_equal_offline_generation(process_server, offline):
    url, _, _ = process_server
    prompts = [[5, 7, 9], [11, 13, 17, 19, 23], [29, 31]]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, expected in zip(prompts, want):
        status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == expected.outputs[0].text
        assert body["usage"]["completion_tokens"] == 8


def test_streamed_text_equals_the_whole_answer(process_server):
    url, _, _ = process_server
    body = {"model": MODEL_NAME, "prompt": [5, 7, 9], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, whole = post(url + "/v1/completions", body)
    assert status == 200
    lines, first_read = [], threading.Event()
    stream_lines(url, body, first_read, lines)
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])
    assert text == whole["choices"][0]["text"]


def test_refusals_and_fitted_max_tokens_cross_the_boundary(process_server):
    url, _, _ = process_server
    status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": list(range(5, 300)),
                                                   "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 2**20], "max_tokens": 4})
    assert status == 400, body  # a token id past the vocabulary: the engine core's add_request refuses it
    # max_tokens left out of a chat request: fitted to what the context and the cache hold (the scheduler's
    # admission check, on the server's copy of the core's scheduler).
    status, body = post(url + "/v1/chat/completions", {"model": MODEL_NAME, "max_completion_tokens": None,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body


def test_a_client_gone_frees_its_blocks_in_the_core_and_metrics_move(process_server):
    url, _, _ = process_server
    before = wait_idle(url)
    lines, first_read = [], threading.Event()
    body = {"model": MODEL_NAME, "prompt": [5, 7, 9], "max_tokens": 200, "ignore_eos": True}
    client = threading.Thread(target=stream_lines, args=(url, body, first_read, lines, False), daemon=True)
    client.start()
    assert first_read.wait(60)
    client.join(30)
    after = wait_idle(url)
    assert after["kvpage:num_requests_running"] == 0 and after["kvpage:kv_cache_usage_perc"] == 0
    assert after["kvpage:generation_tokens_total"] > before["kvpage:generation_tokens_total"]
    assert after["kvpage:prompt_tokens_total"] >= before["kvpage:prompt_tokens_total"] + 3


def test_an_idle_server_and_its_engine_core_use_no_cpu(process_server):
    url, _, client = process_server
    assert post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4})[0] == 200
    wait_idle(url)
    time.sleep(0.5)
    pid = client.process.pid
    server_cpu, core_cpu, wall = time.process_time(), _cpu_seconds(pid), time.monotonic()
    time.sleep(3)  # this thread sleeps: this process's CPU is the server's threads'
    elapsed = time.monotonic() - wall
    server = (time.process_time() - server_cpu) / elapsed
    core = (_cpu_seconds(pid) - core_cpu) / elapsed
    assert server < IDLE_CPU_LIMIT and core < IDLE_CPU_LIMIT, f"idle: server {server:.1%}, core {core:.1%} of a core"


def test_a_killed_engine_core_fails_its_requests_with_503_and_says_so(model_dir):
    """A stream in flight (if it did not finish first) and a request the core was sent but never answered
    (the core is stopped with SIGSTOP first, so that one surely is in flight) both end 503 once the core is
    killed; later requests are 503 at once and on_dead ran."""
    died: list[Exception] = []
    client = _core(model_dir)
    try:
        with running_server(client, on_engine_dead=died.append) as (url, app):
            lines, first_read = [], threading.Event()
            body = {"model": MODEL_NAME, "prompt": [5, 7, 9], "max_tokens": 250, "ignore_eos": True}
            stream = threading.Thread(target=stream_lines, args=(url, body, first_read, lines), daemon=True)
            stream.start()
            assert first_read.wait(60)
            os.kill(client.process.pid, signal.SIGSTOP)
            answers = []
            waiting = threading.Thread(target=lambda: answers.append(post(url + "/v1/completions", body)),
                                       daemon=True)
            waiting.start()
            loop = app.state.ctx.engine_loop
            deadline = time.monotonic() + 30
            while not loop._adding and time.monotonic() < deadline:  # sent to the stopped core
                time.sleep(0.01)
            os.kill(client.process.pid, signal.SIGKILL)
            waiting.join(60)
            stream.join(60)
            assert not stream.is_alive() and not waiting.is_alive(), "a request hung after the core was killed"
            status, answer = answers[0]
            assert status == 503 and answer["error"]["code"] == "engine_dead", answer
            assert "killed by signal 9" in answer["error"]["message"]
            assert lines[-1] == "[DONE]"
            errors = [json.loads(line)["error"] for line in lines if line.startswith('{"error"')]
            assert all(e["code"] == "engine_dead" for e in errors)  # none where it finished before the signal
            deadline = time.monotonic() + 30  # on_dead runs once the requests were told
            while not died and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(died) == 1 and "killed by signal 9" in str(died[0])
            assert get_status(url, "/health") == 503
            status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4})
            assert status == 503 and body["error"]["code"] == "engine_dead", body
            assert "kvpage:num_requests_running" in scrape(url)  # /metrics still answers
    finally:
        client.shutdown()


def test_the_tensor_parallel_driver_is_the_engine_core(model_dir, offline):
    """--tensor-parallel-size 2 under a process core: the core's LLM is the driver and starts the workers."""
    client = MPEngineCoreClient(model_dir, {"num_kv_blocks": 64, "tensor_parallel_size": 2}, start_timeout=300)
    try:
        with running_server(client) as (url, _):
            prompt = [5, 7, 9]
            want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
            status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True})
            assert status == 200 and body["choices"][0]["text"] == want, body
    finally:
        client.shutdown()
