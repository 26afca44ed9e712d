"""sse.peek: the first chunk awaited before the response starts, then replayed with the rest;
closing what it returns closes the stream (the replica then aborts the request). sse.EventStream:
the response that sends a started stream's events, driven here as an ASGI server would."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ingress import sse
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError


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


class Client:
    """An ASGI server's side of one request: what was sent, and a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def endless(closed: asyncio.Event | None = None):
    """A chunk every 10 ms until the stream is closed (which sets `closed`)."""
    try:
        while True:
            yield 1
            await asyncio.sleep(0.01)
    finally:
        if closed is not None:
            closed.set()


def _events(item) -> list[dict]:
    return [{"n": n} for n in range(item)]  # item n: n events


def test_each_chunk_is_one_body_message_and_done_ends_the_last():
    async def run():
        client, stream = Client(), Stream([1, 0, 2])
        await sse.EventStream(stream, _events, "openai", done=True)(
            {"type": "http"}, client.receive, client.send
        )
        return client, stream

    client, stream = asyncio.run(run())
    start, *bodies = client.sent
    assert start["status"] == 200
    assert dict(start["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert [m["body"] for m in bodies] == [
        b'data: {"n":0}\n\n',  # the chunk without events sent nothing
        b'data: {"n":0}\n\ndata: {"n":1}\n\n',
        sse.DONE,
    ]
    assert [m["more_body"] for m in bodies] == [True, True, False]
    assert stream.closed


def test_a_failure_mid_stream_is_the_last_event_in_the_familys_envelope():
    async def run(family, done):
        client = Client()
        stream = Stream([1], fail=RuntimeError("boom"))
        await sse.EventStream(stream, _events, family, done=done)(
            {"type": "http"}, client.receive, client.send
        )
        return client.body()

    body = asyncio.run(run("openai", True))
    assert body.startswith(b'data: {"n":0}\n\ndata: {"error":') and body.endswith(sse.DONE)
    assert b"boom" not in body  # internals stay in the server's log
    assert not asyncio.run(run("mindie", False)).endswith(sse.DONE)


def test_a_client_that_goes_away_closes_the_stream_and_the_response_ends_quietly():
    async def run():
        client = Client()
        closed = asyncio.Event()

        response = asyncio.ensure_future(
            sse.EventStream(endless(closed), _events, "openai", done=True)(
                {"type": "http"}, client.receive, client.send
            )
        )
        await asyncio.sleep(0.05)
        client.gone.set()
        await asyncio.wait_for(response, 1)  # returns, no CancelledError
        assert closed.is_set()
        sent = len(client.sent)
        await asyncio.sleep(0.05)
        return sent, client, response

    sent, client, response = asyncio.run(run())
    assert len(client.sent) == sent and not response.cancelled()
    assert client.sent[-1]["more_body"] is True  # nothing after the client left


def test_a_cancellation_from_elsewhere_still_cancels():
    async def run():
        client = Client()

        async def slow():
            await asyncio.sleep(10)
            yield 1

        response = asyncio.ensure_future(
            sse.EventStream(slow(), _events, "openai")(
                {"type": "http"}, client.receive, client.send
            )
        )
        await asyncio.sleep(0.02)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response

    asyncio.run(run())


def test_a_receive_that_fails_ends_the_stream_like_a_disconnect():
    async def run():
        client = Client()

        async def broken() -> dict:
            raise RuntimeError("the server's receive failed")

        await asyncio.wait_for(
            sse.EventStream(endless(), _events, "openai")({"type": "http"}, broken, client.send), 1
        )
        return client

    assert asyncio.run(run()).sent[0]["type"] == "http.response.start"


def test_the_body_goes_out_from_a_task_of_its_own_that_an_outside_cancel_ends_too():
    """Chunks resume a shallow task, not the request's (under every ASGI layer); cancelling the
    request still closes the stream, so the replica aborts it."""

    async def run():
        client, closed, senders = Client(), asyncio.Event(), set()

        async def send(message: dict) -> None:
            senders.add((message["type"], asyncio.current_task()))
            await client.send(message)

        response = asyncio.ensure_future(
            sse.EventStream(endless(closed), _events, "openai")(
                {"type": "http"}, client.receive, send
            )
        )
        await asyncio.sleep(0.05)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response
        return response, senders, closed.is_set()

    response, senders, closed = asyncio.run(run())
    assert ("http.response.start", response) in senders
    body_tasks = {task for kind, task in senders if kind == "http.response.body"}
    assert len(body_tasks) == 1 and response not in body_tasks
    assert closed


async def late(delay_s: float, items, fail: BaseException | None = None, closed=None):
    """The first item after `delay_s`, then the rest (then `fail`, if given)."""
    try:
        await asyncio.sleep(delay_s)
        for item in items:
            yield item
        if fail is not None:
            raise fail
    finally:
        if closed is not None:
            closed.set()


def test_a_stream_that_waits_for_its_first_token_sends_keep_alive_comments():
    async def run():
        client = Client()
        chunks = await sse.peek(late(0.28, [1, 2]), 0.05)  # answered after KEEPALIVE_S, not 0.28 s
        await sse.EventStream(chunks, _events, "openai", done=True)(
            {"type": "http"}, client.receive, client.send
        )
        return client

    client = asyncio.run(run())
    bodies = [m["body"] for m in client.sent[1:]]
    keepalives = [b for b in bodies if b == sse.KEEPALIVE]
    assert 3 <= len(keepalives) <= 6 and bodies[: len(keepalives)] == keepalives  # before data
    assert bodies[len(keepalives) :] == [
        b'data: {"n":0}\n\n',
        b'data: {"n":0}\n\ndata: {"n":1}\n\n',
        sse.DONE,
    ]


def test_a_quick_first_token_sends_none_and_a_late_refusal_is_the_last_event():
    async def run(delay_s):
        client = Client()
        failing = late(delay_s, [], fail=APIError(ErrorKind.VALIDATION, "too long", "prompt"))
        chunks = await sse.peek(failing, 0.05)
        await sse.EventStream(chunks, _events, "openai", done=True)(
            {"type": "http"}, client.receive, client.send
        )
        return client

    with pytest.raises(APIError):  # refused at once: still an HTTP error
        asyncio.run(run(0))
    client = asyncio.run(run(0.12))  # refused after the 200: the stream's last event
    assert client.sent[0]["status"] == 200
    assert client.body().startswith(sse.KEEPALIVE) and b'"too long"' in client.body()
    assert client.body().endswith(sse.DONE)


def test_a_client_gone_while_waiting_closes_the_stream():
    async def run():
        client, closed = Client(), asyncio.Event()
        chunks = await sse.peek(late(60, [1], closed=closed), 0.05)
        response = asyncio.ensure_future(
            sse.EventStream(chunks, _events, "openai")(
                {"type": "http"}, client.receive, client.send
            )
        )
        await asyncio.sleep(0.12)
        client.gone.set()
        await asyncio.wait_for(response, 5)
        await asyncio.wait_for(closed.wait(), 5)  # the request was abandoned upstream
        return client

    assert asyncio.run(run()).body().startswith(sse.KEEPALIVE)


def test_a_queued_stream_over_http_gets_keep_alive_comments_before_its_first_token(monkeypatch):
    """The app with streamKeepAlive 0.1 s, its engine held before its first step for 0.6 s."""
    import threading

    from fastapi.testclient import TestClient

    from tests.ingress.conftest import ROUTE_TEST_CONFIG, local_app
    from tests.stepping import Stepping

    config = {**ROUTE_TEST_CONFIG, "ServerConfig": {"streamKeepAlive": 0.1}}
    config.pop("EmbeddingConfig")
    app, replica = local_app(config)
    try:
        stepping = Stepping(replica.engine.engine, monkeypatch)
        hold = stepping.hold_before(1)
        threading.Timer(0.6, hold.set).start()
        body = {"model": "demo", "prompt": "hi", "max_tokens": 2, "stream": True}
        with TestClient(app) as client:
            reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200
        text = reply.content
        assert text.startswith(sse.KEEPALIVE) and text.count(sse.KEEPALIVE) >= 3
        assert b"data: {" in text and text.endswith(sse.DONE)
    finally:
        replica.shutdown()
