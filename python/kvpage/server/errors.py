"""Every failure as OpenAI's error JSON: bad requests (400, naming the field), a wrong API key (401),
a full waiting queue (503), a failed engine step (500); FastAPI's 422 for a body that does not
validate becomes a 400 like the rest."""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .engine_loop import EngineStepError, QueueFull
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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(loc) or None
    return (f"{param}: {first.get('msg')}" if param else f"request body: {first.get('msg')}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        return error_response(str(exc), 503, code="queue_full")

    @app.exception_handler(EngineStepError)
    async def _failed(request: Request, exc: EngineStepError):
        return error_response(str(exc), 500, code="engine_error")
