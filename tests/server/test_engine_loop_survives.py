"""The engine loop survives anything a client or an embedding application does (issue 49, finding 2): a
submission cancelled at any moment (before the loop thread takes it, while it is added, while its
outputs stream) aborts its request, the loop thread stays alive, /health stays 200 and every block is freed."""
from __future__ import annotations

import asyncio
import random
import time
import urllib.request

from kvpage import SamplingParams
from kvpage.server.serving import EnginePrompt, submit
from server_helpers import make_llm, running_server, wait_idle

NUM_SUBMISSIONS = 1000


class _Req:
    """What submit() reads of a request body."""
    cache_salt = None
    model_fields = {"prompt": None}


async def _one(ctx, i: int, rng: random.Random) -> None:
    sub = await submit(ctx, f"cancel-{i}", [EnginePrompt(None, [5 + i % 50, 7, 9])],
                       SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True), _Req(), "prompt")
    async for _ in sub.outputs():
        await asyncio.sleep(0)


async def _cancel_randomly(ctx, rng: random.Random) -> int:
    """Every submission started, then cancelled after a random delay (0 to 3 ms: before, during or
    after the loop thread takes it); the number that finished before their cancel came."""
    tasks = []
    for i in range(NUM_SUBMISSIONS):
        task = asyncio.ensure_future(_one(ctx, i, rng))
        asyncio.get_running_loop().call_later(rng.random() * 0.003, task.cancel)
        tasks.append(task)
        if i % 50 == 0:
            await asyncio.sleep(0.002)  # some reach the engine and run a few steps before their cancel
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        assert r is None or isinstance(r, asyncio.CancelledError), r
    return sum(r is None for r in results)


def _health(url: str, method: str = "GET") -> int:
    request = urllib.request.Request(url + "/health", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def _wait_drained(llm, timeout: float = 30.0) -> None:
    """Until the engine holds no request and no block. /metrics alone cannot say so: before the engine's first
    step ends it reports the initial zero counts while that step still holds a request's block."""
    engine, deadline = llm.llm_engine, time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.block_manager.device.num_used:
        assert time.monotonic() < deadline, "the engine still holds requests or blocks: a leak"
        time.sleep(0.05)


def test_1000_randomly_cancelled_submissions(model, tok):
    llm = make_llm(model, tok, num_kv_blocks=256)
    try:
        with running_server(llm) as (url, app):
            ctx = app.state.ctx
            finished = asyncio.run(_cancel_randomly(ctx, random.Random(0)))
            assert finished < NUM_SUBMISSIONS  # the cancels did land
            assert ctx.engine_loop.is_alive and _health(url) == 200
            _wait_drained(llm)
            metrics = wait_idle(url)
            assert metrics["kvpage:num_requests_running"] == 0 and metrics["kvpage:num_requests_waiting"] == 0
            assert metrics["kvpage:kv_cache_usage_perc"] == 0
            assert llm.llm_engine.block_manager.device.num_used == 0
            assert not llm.llm_engine.has_unfinished_requests()
            assert asyncio.run(_served(ctx)) == 2  # and it still serves
    finally:
        llm.shutdown()


async def _served(ctx) -> int:
    sub = await submit(ctx, "after", [EnginePrompt(None, [5, 7, 9])], SamplingParams(max_tokens=2, ignore_eos=True),
                       _Req(), "prompt")
    outputs = [out async for _, out in sub.outputs()]
    return len(outputs[-1].outputs[0].token_ids)


def test_a_closed_event_loop_withdraws_its_requests(model, tok):
    """An embedding application adds a request and closes its event loop: the loop thread cannot deliver
    the outputs, withdraws the request (its blocks freed) and goes on serving."""
    llm = make_llm(model, tok, num_kv_blocks=64)
    try:
        with running_server(llm) as (url, app):
            ctx = app.state.ctx

            async def add_and_leave():
                await ctx.engine_loop.add_request("orphan", None, [5, 7, 9], SamplingParams(max_tokens=200,
                                                  ignore_eos=True), None, asyncio.Queue())
            asyncio.run(add_and_leave())  # returns at once; asyncio.run closes the loop
            _wait_drained(llm)
            metrics = wait_idle(url)
            assert metrics["kvpage:generation_tokens_total"] < 200  # withdrawn, not run to its end
            assert ctx.engine_loop.is_alive and _health(url) == 200
            assert metrics["kvpage:num_requests_running"] == 0 and metrics["kvpage:kv_cache_usage_perc"] == 0
            assert asyncio.run(_served(ctx)) == 2
    finally:
        llm.shutdown()
