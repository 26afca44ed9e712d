"""Server-sent events framing, and the "peek the first chunk" start of every stream.

Peeking means an error that happens before any token exists (a rejected request, an engine that
cannot take it) is still an HTTP error with the family's status and body, and only a stream that
has really started answers 200 (Ray Serve LLM does the same).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from fastapi.responses import StreamingResponse

from serve_app.ingress.request_ids import internal_error
from serve_app.messages import ReplicaChunk
from serve_app.protocol.errors import APIError, Family
from serve_app.protocol.event_json import compact_json

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def event(payload: dict) -> bytes:
    """One SSE event; compact JSON like MindIE's examples, non-ASCII text kept as is."""
    return b"data: " + compact_json(payload) + b"\n\n"


async def peek(chunks: AsyncIterator[ReplicaChunk]) -> AsyncIterator[ReplicaChunk]:
    """Awaits the first chunk now (errors raise here, before the response starts) and returns
    an iterator that yields it again followed by the rest."""
    first = await anext(chunks, None)
    return _Replay(first, chunks)


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


def sse_response(events: AsyncIterator[bytes], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type=MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


async def rendered(
    chunks: AsyncIterator[ReplicaChunk],
    render: Callable[[ReplicaChunk], list[dict]],
    family: Family,
    done: bool = False,
    frame: Callable[[dict], bytes] = event,
    error_event: Callable[[APIError], dict] | None = None,
) -> AsyncIterator[bytes]:
    """SSE bytes of each chunk's rendered payloads. A failure after the 200 can only travel in
    the stream: it is the last event, in the family's error envelope or as `error_event` makes
    it (then `[DONE]` if the family ends streams with it). `frame`: how a payload is written
    (the Responses API puts its type on an `event:` line too)."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                for payload in render(chunk):
                    yield frame(payload)
    except Exception as exc:  # a bug, too, must end the stream in the family's envelope
        error = exc if isinstance(exc, APIError) else internal_error(exc)
        payload = error_event(error) if error_event else error.body(family, in_stream=True)
        yield frame(payload)
    if done:
        yield DONE
