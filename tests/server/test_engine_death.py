"""Serving at the engine's speed without losing integrity (issue 47): a step's outputs reach the event loop
in one wake-up, an idle server burns no CPU, and an engine loop that dies (a BaseException out of a step)
fails every stream in flight with a clear error instead of leaving it hanging, answers 503 afterwards and
tells the server (`kvpage serve` exits on it)."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from contextlib import contextmanager

import pytest

import kvpage
from kvpage import SamplingParams
from kvpage.server.cli_args import add_serve_parser
from kvpage.server.engine_loop import EngineDead
from kvpage.server.serving import EnginePrompt, submit
from server_helpers import (MODEL_NAME, _free_port, get_status, make_llm, post, running_server, stream_lines,
                            wait_idle)

IDLE_CPU_LIMIT = 0.02  # of one core


class _Req:
    """What submit() reads of a request body."""
    cache_salt = None
    model_fields = {"prompt": None}


class _Fatal(BaseException):
    """What no `except Exception` catches: the engine loop thread dies of it."""


def _fatal(out):
    raise _Fatal("boom")


@contextmanager
def _serving(model, tok, **app_kwargs):
    """(base URL, app, llm) of a running server over its own tiny LLM."""
    llm = make_llm(model, tok, num_kv_blocks=128)
    try:
        with running_server(llm, **app_kwargs) as (url, app):
            yield url, app, llm
    finally:
        llm.shutdown()


def test_a_dead_engine_loop_fails_its_streams_answers_503_and_says_so(model, tok):
    died: list[Exception] = []
    with _serving(model, tok, on_engine_dead=died.append) as (url, app, llm):
        lines, first_read = [], threading.Event()
        body = {"model": MODEL_NAME, "prompt": [5, 7, 9], "max_tokens": 200, "ignore_eos": True}
        client = threading.Thread(target=stream_lines, args=(url, body, first_read, lines), daemon=True)
        runner, execute = llm.llm_engine.runner, llm.llm_engine.runner.execute
        runner.execute = lambda out: (time.sleep(0.05), execute(out))[1]  # slow enough to die mid-stream
        client.start()
        assert first_read.wait(30)
        runner.execute = _fatal
        client.join(30)
        assert not client.is_alive(), "the stream hung after the engine loop died"
        errors = [json.loads(line)["error"] for line in lines if line.startswith('{"error"')]
        assert len(errors) == 1 and errors[0]["code"] == "engine_dead" and "_Fatal: boom" in errors[0]["message"]
        assert lines[-1] == "[DONE]" and len(lines) < 200
        deadline = time.monotonic() + 10  # on_dead runs once the streams were told
        while not died and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(died) == 1 and isinstance(died[0], EngineDead)
        assert not app.state.ctx.engine_loop.is_alive and get_status(url, "/health") == 503


def test_after_death_new_requests_are_503_at_once_and_blocks_are_freed(model, tok):
    with _serving(model, tok) as (url, app, llm):
        llm.llm_engine.runner.execute = _fatal
        status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4})
        assert status == 503 and body["error"]["code"] == "engine_dead", body  # the request in flight
        start = time.monotonic()
        status, body = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4})
        assert status == 503 and body["error"]["code"] == "engine_dead" and time.monotonic() - start < 5
        assert llm.llm_engine.block_manager.device.num_used == 0  # withdrawn from the engine too
        assert not llm.llm_engine.has_unfinished_requests()


async def _count_wake_ups(ctx, num_requests: int, max_tokens: int) -> tuple[int, int]:
    """(call_soon_threadsafe calls on this event loop, engine steps) while num_requests stream."""
    loop = asyncio.get_running_loop()
    calls, original = [0], loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    loop.call_soon_threadsafe = counted
    engine = ctx.engine_loop.engine
    steps = engine.num_steps
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    subs = [await submit(ctx, f"wake-{i}", [EnginePrompt(None, [5 + i, 7, 9])], params, _Req(), "prompt")
            for i in range(num_requests)]

    async def drain(sub):
        return [out async for _, out in sub.outputs()][-1]
    finals = await asyncio.gather(*(drain(s) for s in subs))
    assert all(len(f.outputs[0].token_ids) == max_tokens for f in finals)
    return calls[0] - num_requests, engine.num_steps - steps  # less the submissions' own answers


def test_a_step_wakes_the_event_loop_once(model, tok):
    with _serving(model, tok) as (url, app, llm):
        wake_ups, steps = asyncio.run(_count_wake_ups(app.state.ctx, 16, 8))
        assert wake_ups <= steps < 16 * 8  # one per step, not one per request and step


def test_an_idle_server_uses_no_cpu(model, tok):
    with _serving(model, tok) as (url, app, llm):
        status, _ = post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4})
        assert status == 200
        wait_idle(url)
        time.sleep(0.5)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(3)  # this thread sleeps: the process's CPU is the server's threads'
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        assert used < IDLE_CPU_LIMIT, f"an idle server used {used:.1%} of a core"


def test_kvpage_serve_exits_with_status_1_when_its_engine_loop_dies(model, tok, monkeypatch):
    """run_server (on this thread, as the CLI runs it) returns once the engine loop died: SystemExit with
    the cause, after the request in flight was answered 503."""
    llm = make_llm(model, tok, num_kv_blocks=64)
    llm.llm_engine.runner.execute = _fatal
    monkeypatch.setattr(kvpage, "LLM", lambda **kwargs: llm)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    port = _free_port()
    args = parser.parse_args(["serve", "--port", str(port), "--served-model-name", MODEL_NAME, "--engine-core",
                              "inprocess"])
    answers = []

    def client():
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _status_or_none(url) != 200:
            time.sleep(0.05)
        answers.append(post(url + "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 7], "max_tokens": 4}))
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    with pytest.raises(SystemExit, match="engine loop died.*_Fatal: boom"):
        args.fn(args)
    thread.join(30)
    assert answers and answers[0][0] == 503 and answers[0][1]["error"]["code"] == "engine_dead"


def _status_or_none(url: str) -> int | None:
    try:
        return get_status(url, "/health")
    except OSError:
        return None


def test_shutdown_tells_the_requests_in_flight_and_frees_their_blocks(model, tok):
    """A server shutting down answers what is in flight 503 (EngineDead), not a step error, and the core
    withdraws the requests first. The step is slowed so that 200 tokens cannot finish before the shutdown."""
    from kvpage.server.engine_loop import EngineLoop
    llm = make_llm(model, tok, num_kv_blocks=64)
    runner, execute = llm.llm_engine.runner, llm.llm_engine.runner.execute
    runner.execute = lambda out: (time.sleep(0.05), execute(out))[1]

    async def main():
        engine_loop = EngineLoop(llm)
        engine_loop.start()
        outputs = asyncio.Queue()
        await engine_loop.add_request("r", None, [5, 7, 9], SamplingParams(max_tokens=200, ignore_eos=True), None,
                                      outputs)
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.shutdown)
        while not isinstance(item := await asyncio.wait_for(outputs.get(), 30), Exception):
            assert not item.finished
        return item
    try:
        error = asyncio.run(main())
        assert isinstance(error, EngineDead) and "shutting down" in str(error)
        assert llm.llm_engine.block_manager.device.num_used == 0 and not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()
