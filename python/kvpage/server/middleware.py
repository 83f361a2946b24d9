"""Two pure ASGI middlewares, which answer before FastAPI parses anything: the API key (401 on every route
but the open ones) and the request-body limit (413 as soon as the bytes that arrived pass it, whether the
body came with a Content-Length or chunked). Both answer in OpenAI's error JSON; what they refuse is read
only to be dropped (drain), never kept or parsed.

Pure ASGI rather than FastAPI dependencies: a dependency runs after the body was read and parsed, so a
client without a key could still make the server parse 10 MB, and malformed JSON got its 400 before the 401.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

from .protocol import error_body

# Before a 401 / 413 goes out, the rest of the body is read and dropped, up to this much for this long: a
# client that sends its whole body before reading (urllib, with Connection: close) would otherwise find the
# connection closed under it and never see the answer. A client that waits (Expect: 100-continue) sends none.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_SECONDS = 10.0


def default_max_request_body_bytes(max_model_len: int | None) -> int:
    """A body limit that any request for max_model_len tokens fits with room to spare: 256 bytes per
    token (a token's text is a few characters, 6 bytes each where JSON escapes them; as an id, at most
    7), at least 1 MiB; 16 MiB where the context limit is unknown."""
    if max_model_len is None:
        return 16 << 20
    return max(1 << 20, 256 * max_model_len)


async def send_error(send, status: int, message: str, code: str | None = None, headers=()) -> None:
    body = json.dumps(error_body(message, status, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def drain(scope, receive) -> None:
    if (_header(scope, b"expect") or b"").lower() == b"100-continue":
        return
    deadline, drained = time.monotonic() + DRAIN_MAX_SECONDS, 0
    while drained < DRAIN_MAX_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class ApiKeyMiddleware:
    """'Authorization: Bearer <key>' on every HTTP route but `open_paths` (compared in constant time)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app, self.open_paths = app, open_paths
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if not hmac.compare_digest(_header(scope, b"authorization") or b"", self.expected):
                await drain(scope, receive)
                await send_error(send, 401, "incorrect or missing API key: send the header"
                                 " 'Authorization: Bearer <key>'", "invalid_api_key",
                                 [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads an HTTP request's body, up to max_bytes, before the app sees it (the app reads it whole
    anyway) and hands it on in one piece; past max_bytes (or a Content-Length past it) it answers 413,
    keeping nothing of the body (drain). The app's later receive() calls (a disconnect) go to the
    connection as before."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await drain(scope, receive)
            await self._refuse(send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body was complete: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await drain(scope, receive)
                await self._refuse(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more"
        await send_error(send, 413, f"the request body has {size}; this server takes at most {self.max_bytes}"
                         " bytes (--max-request-body-bytes)", "request_too_large")


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay

