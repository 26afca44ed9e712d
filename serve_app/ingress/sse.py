"""Server-sent events: framing, the "peek the first chunk" start of every stream, and the
response that sends a started stream (`EventStream`).

Peeking means an error that happens before any token exists (a rejected request, an engine that
cannot take it) is still an HTTP error with the family's status and body, and only a stream that
has really started answers 200 (Ray Serve LLM does the same). A request that waits longer than
`ServerConfig.streamKeepAlive` seconds for its first token (queued behind a full batch, say) is
answered 200 then, and an SSE comment (`: keep-alive`) goes out as often until it comes, so that
proxies and load balancers that cut idle connections do not cut queued streams; an error after
that is the stream's last event, as any error after the 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from serve_app.ingress.request_ids import internal_error
from serve_app.messages import ReplicaChunk
from serve_app.protocol.errors import APIError, Family
from serve_app.protocol.event_json import compact_json

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
KEEPALIVE = b": keep-alive\n\n"


def event(payload: dict) -> bytes:
    """One SSE event; compact JSON like MindIE's examples, non-ASCII text kept as is."""
    return b"data: " + compact_json(payload) + b"\n\n"


async def peek(
    chunks: AsyncIterator[ReplicaChunk], keepalive_s: float = 0.0
) -> AsyncIterator[ReplicaChunk]:
    """Awaits the first chunk (errors raise here, before the response starts) and returns an
    iterator that yields it again followed by the rest; with keepalive_s, for that long at most,
    and past it one that yields KEEPALIVE every keepalive_s until the first chunk comes."""
    if not keepalive_s:
        return _Replay(await anext(chunks, None), chunks)
    first = asyncio.ensure_future(anext(chunks, None))
    try:
        await asyncio.wait_for(asyncio.shield(first), keepalive_s)
    except TimeoutError:
        return _Waiting(first, chunks, keepalive_s)
    except BaseException:
        first.cancel()
        raise
    return _Replay(first.result(), chunks)


class _Waiting:
    """KEEPALIVE while the first chunk is pending, then it and the rest of `chunks` (an error
    of the first ends the stream as any later one does)."""

    def __init__(
        self, first: asyncio.Future, chunks: AsyncIterator[ReplicaChunk], every_s: float
    ) -> None:
        self._first: asyncio.Future | None = first
        self._chunks, self._every_s = chunks, every_s

    def __aiter__(self) -> _Waiting:
        return self

    async def __anext__(self) -> ReplicaChunk | bytes:
        first = self._first
        if first is None:
            return await self._chunks.__anext__()
        done, _ = await asyncio.wait([first], timeout=self._every_s)
        if not done:
            return KEEPALIVE
        self._first = None
        chunk = first.result()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        if self._first is not None:
            self._first.cancel()
            self._first = None
        await self._chunks.aclose()


class _Replay:
    """`first`, then the rest of `chunks`: after the first, each `__anext__` is the stream's
    own (not an async generator around it: one hop less per streamed chunk). Closing it
    closes the stream."""

    def __init__(self, first: ReplicaChunk | None, chunks: AsyncIterator[ReplicaChunk]) -> None:
        self._first, self._chunks = first, chunks

    def __aiter__(self) -> _Replay:
        return self

    def __anext__(self) -> Awaitable[ReplicaChunk]:
        first, self._first = self._first, None
        if first is not None:
            return _ready(first)
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._chunks.aclose()


async def _ready(value: ReplicaChunk) -> ReplicaChunk:
    return value


class EventStream(Response):
    """The 200 `text/event-stream` response of a started stream: each item of `chunks` rendered
    into its events (`render`, then `frame` for each payload), sent as one body message. A failure
    after the 200 can only travel in the stream: it is the last event, in the family's error
    envelope or as `error_event` makes it; `done` ends the stream with `[DONE]` (sent with the
    end of the body, one write). `frame`: how a payload is written (the Responses API puts its
    type on an `event:` line too).

    Starlette's StreamingResponse would do the same through a task group per request (a cancel
    scope, the client's disconnect awaited beside the body) and an async generator of events in
    between; here the body is a plain task, and a client that goes away cancels it from a watcher
    (the stream is then closed, and so the request abandoned in its replica)."""

    media_type = MEDIA_TYPE

    def __init__(
        self,
        chunks: AsyncIterator[Any],
        render: Callable[[Any], list[dict]],
        family: Family,
        done: bool = False,
        frame: Callable[[dict], bytes] = event,
        error_event: Callable[[APIError], dict] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks, self._render, self._family = chunks, render, family
        self._done, self._frame, self._error_event = done, frame, error_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        # The body goes out from a task of its own: every chunk resumes the task that waits for
        # it, and this call's task is resumed through each frame of the ASGI stack above it (Ray
        # Serve's wrappers, the middleware, the router: ~25), the body's through its own few.
        body = asyncio.ensure_future(self._body(send))
        gone = False

        def disconnected(watcher: asyncio.Future) -> None:
            nonlocal gone
            if not watcher.cancelled():  # the client went away (or its receive failed)
                watcher.exception()  # retrieved: a failed receive ends the stream like a disconnect
                gone = True
                body.cancel()

        watcher = asyncio.ensure_future(_until_disconnect(receive))
        watcher.add_done_callback(disconnected)
        try:
            await body  # cancelling this task cancels the body too
        except asyncio.CancelledError:
            if gone and not asyncio.current_task().cancelling():
                return  # nobody left to send to; the stream is closed
            raise
        finally:
            watcher.remove_done_callback(disconnected)
            watcher.cancel()

    async def _body(self, send: Send) -> None:
        chunks, render, frame = self._chunks, self._render, self._frame
        tail = b""
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk is KEEPALIVE:  # still waiting for the first token
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        continue
                    payloads = render(chunk)
                    if not payloads:
                        continue
                    body = b"".join(map(frame, payloads))
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception as exc:  # a bug, too, must end the stream in the family's envelope
            error = exc if isinstance(exc, APIError) else internal_error(exc)
            on_error = self._error_event
            tail = frame(on_error(error) if on_error else error.body(self._family, in_stream=True))
        if self._done:
            tail += DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
