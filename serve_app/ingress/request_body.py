"""Request bodies before routing: the size limit, and every POST body read as JSON.

A plain ASGI middleware rather than FastAPI's `@app.middleware("http")`: that one wraps every
response in a second task and passes each streamed chunk through a memory channel, which on a
loaded 2-core machine cost a noticeable share of the ingress's CPU per streamed token. This one
only touches the request side; responses go straight from the route to the server.

A POST body is read here, whole, and replayed to the route: the routes read it whole anyway,
and reading it first is what lets a chunked upload (no Content-Length) be refused with 413 as
soon as it passes `ServerConfig.maxRequestLength`, without buffering more than that.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError, family_for_path, from_validation_errors

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_M = TypeVar("_M", bound=BaseModel)


class RequestBody:
    """ASGI middleware: 413 for a body over `max_bytes` (declared or counted), and a POST's
    content type set to JSON (`curl -d` sends form encoding, MindIE clients often none)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_mb: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_mb = max_mb

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, send, declared)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its request was whole: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(scope, send, None)
                return
            if not message.get("more_body", False):
                break
        await self.app(_as_json(scope), _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_bytes} bytes"
        error = APIError(
            ErrorKind.TOO_LARGE,
            f"the request body has {size}; at most {self.max_mb} MB "
            f"(ServerConfig.maxRequestLength)",
        )
        await error_response(error, scope["path"])(scope, _no_body, send)


def error_response(error: APIError, path: str) -> JSONResponse:
    """The error in the envelope and status of the API family that `path` belongs to."""
    family = family_for_path(path)
    return JSONResponse(error.body(family), status_code=error.status(family))


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _as_json(scope: Scope) -> Scope:
    """The scope with `content-type: application/json` unless it already names JSON."""
    headers = scope["headers"]
    kind = next((v for k, v in headers if k == b"content-type"), b"")
    if b"json" in kind.lower():
        return scope
    headers = [(k, v) for k, v in headers if k != b"content-type"]
    headers.append((b"content-type", b"application/json"))
    return {**scope, "headers": headers}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read already, then the real channel (a streaming
    response listens on it for the client going away)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def json_object(request: Request) -> dict:
    """The request's JSON object (a route whose body has more than one shape reads it so)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:
        raise APIError(ErrorKind.VALIDATION, f"body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise APIError(ErrorKind.VALIDATION, "body must be a JSON object", "body")
    return body


def parse_body(model: type[_M], body: dict) -> _M:
    """`body` as `model`; a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors()), prefix_skip=()) from None
