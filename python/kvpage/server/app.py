"""The FastAPI app: OpenAI's routes under /v1, plus /health, /metrics, /tokenize and /detokenize, over one
EngineLoop that the app's lifespan starts and stops. With an API key every route but /health needs it
(/metrics too, unless metrics_without_auth); the key and the body-size limit are checked by pure ASGI
middlewares, before any body is read or parsed. Tokenizing, chat templating and detokenizing run on a
small thread pool, never on the event loop."""
from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .engine_loop import EngineLoop
from .errors import RequestError, install_error_handlers
from .metrics import ServerMetrics
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware, default_max_request_body_bytes
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import ServingContext
from .serving_chat import chat_prompt, create_chat_completion
from .serving_completion import create_completion


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """work's result, or None if the client went away first: then work is cancelled, which aborts
    its engine requests (Submitted.outputs' finally)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnected(request))
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


class _EventStream(StreamingResponse):
    """Server-sent events that abort the request's engine work however the response ends: a client
    gone before the body started never runs the body's own cleanup. The body streams on the handler's task
    while a watcher task waits for the client to go (then cancels it): StreamingResponse's own way, an anyio
    task group per response whose cancel scope formats the task's repr, cost more CPU than the body's writes."""

    def __init__(self, answer) -> None:
        super().__init__(answer.stream(), media_type="text/event-stream")
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        streaming, gone = asyncio.current_task(), []

        async def watch() -> None:
            await self.listen_for_disconnect(receive)
            gone.append(True)
            streaming.cancel()
        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise  # cancelled from outside (the server is stopping)
            if sys.version_info >= (3, 11):  # Task.uncancel is 3.11's (pyproject allows 3.10, which counts no cancels)
                streaming.uncancel()  # the client went away: the response ends here, as StreamingResponse's does
        finally:
            watcher.cancel()
            self.answer.sub.abort()


async def _respond(answer, stream: bool, request: Request) -> Response:
    if stream:
        return _EventStream(answer)
    body = await _unless_disconnected(request, answer.whole())
    return JSONResponse(body) if body is not None else Response(status_code=499)  # nobody reads it


def _openai_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = int(time.time())

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(await create_completion(ctx, body), body.stream, request)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _respond(await create_chat_completion(ctx, body), body.stream, request)

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": created,
                                            "owned_by": "kvpage", "max_model_len": ctx.max_model_len}]}
    return router


def _tokenizer_routes(ctx: ServingContext, vocab_size: int | None) -> APIRouter:
    router = APIRouter()

    def tokenizer():
        if ctx.tokenizer is None:
            raise RequestError("this model has no tokenizer", "model")
        return ctx.tokenizer

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            tokens = (await ctx.in_pool(chat_prompt, ctx, body.messages)).token_ids
        else:
            encode = tokenizer().encode
            tokens = list(await ctx.in_pool(lambda: encode(body.prompt, add_special_tokens=body.add_special_tokens)))
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise RequestError(f"tokens: {bad[0]} is no token id of this model (vocab_size={vocab_size})", "tokens")
        return {"prompt": await ctx.in_pool(tokenizer().decode, body.tokens)}
    return router


def build_app(llm, served_model_name: str = "kvpage", api_key: str | None = None,
              max_waiting_requests: int | None = None, max_request_body_bytes: int | None = None,
              metrics_without_auth: bool = False, tokenizer_workers: int = 2, on_engine_dead=None) -> FastAPI:
    """The server over a kvpage.LLM (served by an engine core on a thread of this process: its engine then
    belongs to the app, no other caller may step it while the app runs) or over an EngineCoreClient (`kvpage
    serve`'s engine core in a process of its own). The app's lifespan starts and stops the core.
    max_request_body_bytes: a larger body is answered 413 (default: default_max_request_body_bytes of
    max_model_len). tokenizer_workers: the threads that tokenize and template (few: they share the CPU with the
    engine's steps). on_engine_dead(error): called if the engine core dies (its requests already failed, /health
    503); `kvpage serve` exits on it."""
    engine_loop = EngineLoop(llm, max_waiting_requests, on_dead=on_engine_dead)
    info = engine_loop.client.info
    pool = ThreadPoolExecutor(tokenizer_workers, thread_name_prefix="kvpage-tokenizer")
    ctx = ServingContext(engine_loop, info.tokenizer, served_model_name, info.max_model_len,
                         ServerMetrics(engine_loop, served_model_name), info.sampling_defaults, pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.shutdown()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvpage", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(_openai_routes(ctx))
    app.include_router(_tokenizer_routes(ctx, info.vocab_size))

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD
    async def health():
        if not engine_loop.is_alive:
            raise RequestError("the engine loop is not running", status=503, code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: the key is checked before a byte of the body is read.
    if max_request_body_bytes is None:
        max_request_body_bytes = default_max_request_body_bytes(info.max_model_len)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key is not None:
        open_paths = frozenset({"/health", "/metrics"} if metrics_without_auth else {"/health"})
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    return app
