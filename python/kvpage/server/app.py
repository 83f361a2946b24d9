"""The FastAPI app: OpenAI's routes under /v1 (behind --api-key where one is set), plus /health,
/metrics, /tokenize and /detokenize, over one EngineLoop that the app's lifespan starts and stops."""
from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .engine_loop import EngineLoop
from .errors import RequestError, install_error_handlers
from .metrics import ServerMetrics
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
    gone before the body started never runs the body's own cleanup."""

    def __init__(self, answer) -> None:
        super().__init__(answer.stream(), media_type="text/event-stream")
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.sub.abort()


async def _respond(answer, stream: bool, request: Request) -> Response:
    if stream:
        return _EventStream(answer)
    body = await _unless_disconnected(request, answer.whole())
    return JSONResponse(body) if body is not None else Response(status_code=499)  # nobody reads it


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError("incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")
    return check


def _openai_routes(ctx: ServingContext, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])
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
            tokens = chat_prompt(ctx, body.messages).token_ids
        else:
            tokens = list(tokenizer().encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise RequestError(f"tokens: {bad[0]} is no token id of this model (vocab_size={vocab_size})", "tokens")
        return {"prompt": tokenizer().decode(body.tokens)}
    return router


def build_app(llm, served_model_name: str = "kvpage", api_key: str | None = None,
              max_waiting_requests: int | None = None) -> FastAPI:
    """The server over a kvpage.LLM: its engine then belongs to the app's engine loop (no other
    caller may step it while the app runs)."""
    engine = llm.llm_engine
    engine_loop = EngineLoop(engine, max_waiting_requests)
    ctx = ServingContext(engine_loop, llm.tokenizer, served_model_name, engine.config.max_model_len,
                         ServerMetrics(engine_loop, served_model_name))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.shutdown()

    app = FastAPI(title="kvpage", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(_openai_routes(ctx, api_key))
    app.include_router(_tokenizer_routes(ctx, getattr(engine.runner, "vocab_size", None)))

    @app.get("/health")
    async def health():
        if not engine_loop.is_alive:
            raise RequestError("the engine loop is not running", status=503, code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
    return app
