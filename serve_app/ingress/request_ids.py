"""Request ids: every HTTP request has one, in the `X-Request-ID` response header and in the
server's log lines about it, so that a client's report finds the log.

A client's own `X-Request-ID` is kept, made a plain token (characters other than letters,
digits and `-_.:` become `_`, at most 128 kept); without one a new id is drawn. Under Ray Serve
the proxy has already drawn one when the client sent none (and adds the response header
itself), so the ingress reads the id the proxy put in the request's headers and adds no second
header (`echo=False`).

The id is in a context variable while the request runs; `current()` reads it (log lines, the
message of an internal error). `internal_error` turns an unexpected exception into the client's
error: logged with its traceback under the id, answered without internals. Log lines carry ids,
routes, token counts and timings, never prompt or output text.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from collections.abc import Awaitable

from serve_app.ingress.request_body import ASGIApp, Message, Receive, Scope, Send, error_response
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError

logger = logging.getLogger(__name__)

HEADER = b"x-request-id"
_NOT_PLAIN = re.compile(rb"[^A-Za-z0-9._:-]")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def current() -> str:
    """The id of the HTTP request being served here ("-" outside one)."""
    return _current.get()


class RequestIds:
    """ASGI middleware, the outermost: the request id, and an unexpected exception from inside
    the app answered as `internal_error` in the family's envelope (Starlette's own handler for
    it sits outside every middleware, where the id is gone)."""

    def __init__(self, app: ASGIApp, echo: bool = True) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == HEADER), b"")
        request_id = _NOT_PLAIN.sub(b"_", given[:128]).decode() or uuid.uuid4().hex
        token = _current.set(request_id)
        header = (HEADER, request_id.encode())
        started = False

        def send_with_id(message: Message) -> Awaitable[None]:
            # a plain function handing on send's awaitable: no coroutine of its own for each
            # of a stream's chunks
            nonlocal started
            if not started and message["type"] == "http.response.start":
                started = True
                if self.echo:
                    headers = [h for h in message.get("headers", ()) if h[0].lower() != HEADER]
                    message = {**message, "headers": [*headers, header]}
            return send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # a bug, a replica gone: past every handler of the app
            if started:
                logger.error(
                    "request %s failed after its response started", request_id, exc_info=exc
                )
                return
            response = error_response(internal_error(exc), scope["path"])
            await response(scope, receive, send_with_id)
        finally:
            _current.reset(token)


# Ray's exceptions for a replica that died or cannot be reached, by name (no import of Ray here)
_REPLICA_GONE = {
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
    "TokenStreamLost",  # token_socket/inbox.py: a replica's token socket closed mid-request
}  # fmt: skip
_NO_REPLICA = {"DeploymentUnavailableError", "BackPressureError"}


def internal_error(exc: BaseException) -> APIError:
    """An unexpected failure while serving the current request, for the client: logged here
    with its traceback under the request id, and answered without internals (no exception
    text, paths or stack), naming the id to look for in the log."""
    request_id = current()
    name = type(exc).__name__
    if name in _NO_REPLICA:
        logger.warning("request %s: no replica could take it (%s)", request_id, name)
        return APIError(
            ErrorKind.UNAVAILABLE,
            f"no replica can take the request now; retry later (request id {request_id})",
        )
    logger.error("request %s failed", request_id, exc_info=exc)
    if name in _REPLICA_GONE:
        message = "a replica serving the request failed"
    else:
        message = "internal error"
    return APIError(
        ErrorKind.ENGINE, f"{message}; the server log has the details (request id {request_id})"
    )
