"""sse.peek: the first chunk awaited before the response starts, then replayed with the rest;
closing what it returns closes the stream (the replica then aborts the request)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress import sse


class Stream:
    """An async generator's shape with a record of aclose()."""

    def __init__(self, items, fail: BaseException | None = None) -> None:
        self.items, self.fail, self.closed = list(items), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


def test_the_first_chunk_comes_again_followed_by_the_rest():
    async def run():
        stream = Stream([1, 2, 3])
        replay = await sse.peek(stream)
        assert stream.items == [2, 3]  # the first was taken before the response starts
        return [item async for item in replay]

    assert asyncio.run(run()) == [1, 2, 3]


def test_an_empty_stream_replays_nothing():
    async def run():
        return [item async for item in await sse.peek(Stream([]))]

    assert asyncio.run(run()) == []


def test_an_error_before_the_first_chunk_raises_in_peek_and_later_ones_in_the_replay():
    with pytest.raises(ValueError, match="refused"):
        asyncio.run(sse.peek(Stream([], fail=ValueError("refused"))))

    async def run():
        replay = await sse.peek(Stream([1], fail=RuntimeError("died")))
        return [item async for item in replay]

    with pytest.raises(RuntimeError, match="died"):
        asyncio.run(run())


def test_closing_the_replay_closes_the_stream():
    async def run():
        stream = Stream([1, 2, 3])
        replay = await sse.peek(stream)
        assert await anext(replay) == 1
        await replay.aclose()
        return stream

    assert asyncio.run(run()).closed
