"""Every failure as OpenAI's error JSON: bad requests (400, naming the field), a wrong API key (401),
a full waiting queue (503), a failed engine step (500); FastAPI's 422 for a body that does not
validate becomes a 400 like the rest, and Starlette's own answers (404, 405, a body it cannot read)
lose their {"detail": ...} bodies too."""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .engine_loop import EngineDead, EngineStepError, QueueFull
from .protocol import error_body


class RequestError(Exception):
    """A request the server refuses: status, message, and the field at fault where there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def field_named_in(message: str, fields, aliases: dict[str, str] | None = None) -> str | None:
    """The first request field a ValueError's message names (kvpage's messages lead with the argument),
    mapped through aliases (the engine's `prompt` is chat's `messages`)."""
    aliases = aliases or {}
    for word in re.findall(r"[a-z_]+", message):
        if word in aliases:
            return aliases[word]
        if word in fields:
            return word
    return None


# The names pydantic gives a union's branches in an error's location: not fields.
_BRANCH = re.compile(r"^(str|int|float|bool|list|dict)(\[.*\])?$|\[")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    # Our own checks (value_error) say more than a union's "not a string" for each branch it tried.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _BRANCH.search(str(part))]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(loc) or None
    msg = str(first.get("msg")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else f"request body: {msg}"), param


def _http_message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no route {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow")
        return f"{request.method} is not allowed on {request.url.path}" + (f" (allowed: {allowed})" if allowed else "")
    if exc.status_code == 400:  # FastAPI's "There was an error parsing the body": not UTF-8, ...
        return f"the request body could not be read: {exc.detail}"
    return str(exc.detail)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        response = error_response(_http_message(request, exc), exc.status_code)
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        return error_response(str(exc), 503, code="queue_full")

    @app.exception_handler(EngineStepError)
    async def _failed(request: Request, exc: EngineStepError):
        return error_response(str(exc), 500, code="engine_error")

    @app.exception_handler(EngineDead)  # the engine loop died or the server is stopping: retry elsewhere
    async def _dead(request: Request, exc: EngineDead):
        return error_response(str(exc), 503, code="engine_dead")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        # Anything else is a bug (Starlette logs the traceback): the client still gets OpenAI's error JSON,
        # not a text/plain 500, which the openai client would take for a transient failure and retry.
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, code="internal_error")
