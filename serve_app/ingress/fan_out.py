"""Several requests of one API call as one (a Databricks completion batch, a prompt each):
every result in order or the first failure, and the streams merged as their chunks come. A
failure or a client gone cancels the rest, each one's replica stream closed, so no KV block
outlives the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serve_app.messages import ErrorKind, ReplicaChunk
from serve_app.protocol.errors import APIError


async def gather_all(awaitables) -> list:
    """Every awaitable's result, in order; the first failure cancels the others (each one's
    replica stream is then closed, so no KV block outlives the request)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def until_timeout(
    chunks: AsyncIterator[ReplicaChunk], truncate: bool
) -> AsyncIterator[ReplicaChunk | None]:
    """The chunks; with error_behavior "truncate" a timeout ends them with what the last
    chunk generated, then None (its unfinished choices end with "length")."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        if not truncate or exc.kind != ErrorKind.TIMEOUT:
            raise
        if exc.partial is not None:
            yield exc.partial.cut_short()
        yield None
    finally:
        await chunks.aclose()


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int | None, object]]:
    """(stream index, item) as the streams produce them, then (None, None) when all ended."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(streams[i]))] = i
        yield None, None
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
