"""bench/sse_client.py against a raw socket server that writes exactly the bytes a test gives:
lines split anywhere across reads, keep-alive reuse, errors, a cut connection, cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest


@pytest.fixture(scope="module")
def sc(load_bench):
    return load_bench("sse_client")


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


class Server:
    """Answers the n-th request on any connection with replies[n] (a list of byte pieces sent
    with a pause between them, a None among them closes the connection; a reply None: close the
    connection instead of answering). Records the requests' head
    lines and how many connections were opened."""

    def __init__(self, replies: list) -> None:
        self.replies = replies
        self.requests: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.handlers: list[asyncio.Task] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.handlers.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.bodies.append(await reader.readexactly(length))
                self.requests.append(head.split(b"\r\n")[0])
                reply = self.replies[len(self.requests) - 1]
                if reply is None:
                    return
                for piece in reply:
                    if piece is None:  # hang up
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def into(got: list):
    """An on_line that keeps each line in got and never ends the stream itself."""
    return lambda line, now: got.append(line)


def lines_of(sc, url: str, payload=None, client=None):
    """The (line, time) pairs a POST's body gave, with on_line stopping at [DONE]."""
    got = []

    def on_line(line: str, now: float) -> bool:
        got.append((line, now))
        return line == "data: [DONE]"

    async def run():
        async with client or sc.StreamClient() as c:
            await c.post_lines(url, payload or {"a": 1}, on_line)

    return run, got


def test_lines_split_anywhere_across_reads_arrive_whole_in_order(sc):
    body = chunked(b'data: {"x": ', b"1}\n\nda", b'ta: {"x": 2}\n', b"\ndata: [DONE]\n\n")
    # the response's bytes cut at arbitrary places, also inside the chunked framing
    pieces = [(STREAM_HEAD + body)[i : i + 7] for i in range(0, len(STREAM_HEAD + body), 7)]

    async def main():
        server = Server([pieces])
        async with server as base:
            run, got = lines_of(sc, base + "/v1/completions?x=1", {"prompt": "héllo"})
            await run()
        return server, got

    server, got = asyncio.run(main())
    lines = [line for line, _ in got]
    assert lines == ['data: {"x": 1}', "", 'data: {"x": 2}', "", "data: [DONE]"]
    times = [t for _, t in got]
    assert times == sorted(times) and times[0] < times[-1]  # stamped as they arrived
    assert server.requests == [b"POST /v1/completions?x=1 HTTP/1.1"]
    assert json.loads(server.bodies[0]) == {"prompt": "héllo"}


def test_keep_alive_connections_are_reused_and_get_json_reads_a_json_body(sc):
    stream = [STREAM_HEAD + chunked(b"data: 1\n\n", b"data: [DONE]\n\n")]
    models = json.dumps({"data": [{"id": "demo"}]}).encode()
    plain = [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models)]

    async def main():
        server = Server([plain, stream, stream, stream])
        async with server as base, sc.StreamClient() as client:
            listed = await client.get_json(base + "/v1/models")
            for _ in range(3):
                got = []
                await client.post_lines(base + "/v1/x", {}, into(got))
                assert got == ["data: 1", "", "data: [DONE]", ""]
        return server, listed

    server, listed = asyncio.run(main())
    assert listed == {"data": [{"id": "demo"}]}
    assert server.requests[0] == b"GET /v1/models HTTP/1.1" and len(server.requests) == 4
    assert server.connections == 1


def test_a_status_other_than_200_raises_with_its_body_and_the_next_request_still_works(sc):
    error = json.dumps({"error": {"message": "max_tokens must be >= 1"}}).encode()
    bad = [b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)]
    good = [STREAM_HEAD + chunked(b"data: [DONE]\n\n")]

    async def main():
        async with Server([bad, good]) as base, sc.StreamClient() as client:
            with pytest.raises(sc.HTTPStatusError) as info:
                await client.post_lines(base + "/v1/x", {}, lambda line, now: False)
            got = []
            await client.post_lines(base + "/v1/x", {}, into(got))
            return info.value, got

    exc, got = asyncio.run(main())
    assert exc.status == 400 and b"max_tokens" in exc.body and str(exc).startswith("HTTP 400")
    assert got == ["data: [DONE]", ""]


def test_a_connection_cut_mid_stream_or_garbage_raises_a_connection_error(sc):
    cut = [STREAM_HEAD + chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")], None]

    async def main():
        results = []
        for reply in (cut, [b"garbage\r\n\r\n"], None):
            async with Server([reply]) as base, sc.StreamClient() as client:
                got = []
                try:
                    await client.post_lines(base + "/x", {}, into(got))
                except ConnectionError as exc:
                    results.append((type(exc), got))
        return results

    (cut_exc, cut_lines), (garbage_exc, _), (closed_exc, _) = asyncio.run(main())
    assert cut_exc is ConnectionError and cut_lines == ["data: 1", ""]
    assert garbage_exc is sc.ProtocolError
    assert closed_exc is ConnectionError  # closed before any answer


def test_a_stream_that_ended_itself_is_done_when_the_server_then_closes(sc):
    # no chunked framing, no length: the body runs until the server closes the connection
    reply = [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", b"data: [DONE]\n\n", None]

    async def main():
        async with Server([reply]) as base:
            run, got = lines_of(sc, base + "/x")
            await run()
            return got

    assert [line for line, _ in asyncio.run(main())] == ["data: [DONE]"]


def test_a_body_without_length_or_chunks_ends_when_the_server_closes(sc):
    reply = [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", b'{"data": ', b"[]}", None]

    async def main():
        async with Server([reply]) as base, sc.StreamClient() as client:
            return await client.get_json(base + "/v1/models")

    assert asyncio.run(main()) == {"data": []}


def test_cancelling_a_request_closes_its_connection(sc):
    slow = [STREAM_HEAD] + [b"8\r\ndata: 1\n\r\n"] * 200  # 2 s of chunks

    async def main():
        server = Server([slow, [STREAM_HEAD + chunked(b"data: [DONE]\n\n")]])
        async with server as base, sc.StreamClient() as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post_lines(base + "/x", {}, lambda *_: False), 0.1)
            got = []
            await client.post_lines(base + "/x", {}, into(got))
        return server, got

    server, got = asyncio.run(main())
    assert got == ["data: [DONE]", ""] and server.connections == 2  # a new connection


def test_only_http_urls(sc):
    async def main():
        async with sc.StreamClient() as client:
            await client.get_json("ftp://example.invalid/x")

    with pytest.raises(ValueError, match="ftp://"):
        asyncio.run(main())


def test_on_lines_own_error_is_raised_as_is_mid_stream_and_on_a_last_line_at_close(sc):
    def strict(line: str, now: float) -> bool:  # as bench/serve.py's note_line: JSON or bust
        if line.startswith("data:"):
            json.loads(line[5:])
        return False

    mid = [STREAM_HEAD + chunked(b'data: {"x": 1}\n\n', b"data: {bad\n\n", b"data: 2\n\n")]
    last = [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n", b"data: {bad", None]

    async def main():
        errors = []
        for reply in (mid, last):
            async with Server([reply]) as base, sc.StreamClient() as client:
                t0 = time.perf_counter()
                with pytest.raises(json.JSONDecodeError):
                    await asyncio.wait_for(client.post_lines(base + "/x", {}, strict), 5)
                errors.append(time.perf_counter() - t0)
        return errors

    assert all(waited < 2 for waited in asyncio.run(main()))  # at once, not at the timeout


def test_a_stream_is_over_at_done_and_its_connection_is_reused_once_the_body_ends(sc):
    held = [STREAM_HEAD + b"e\r\ndata: [DONE]\n\n\r\n", b"", b"0\r\n\r\n"]  # the end comes later
    held[1:2] = [b""] * 100  # ~1 s between [DONE] and the body's end

    async def main():
        server = Server([held, [STREAM_HEAD + chunked(b"data: [DONE]\n\n")]])
        async with server as base, sc.StreamClient() as client:
            t0 = time.perf_counter()
            await client.post_lines(base + "/x", {}, lambda line, now: line == "data: [DONE]")
            first = time.perf_counter() - t0
            await asyncio.sleep(1.5)  # the rest of the first body arrives meanwhile
            again = []
            await client.post_lines(base + "/x", {}, into(again))
        return server, first, again

    server, first, again = asyncio.run(main())
    assert first < 0.5  # returned at [DONE], not when the body ended (~1 s later)
    assert again == ["data: [DONE]", ""] and server.connections == 1


def test_chunked_in_any_case_and_an_interim_response_before_the_answer(sc):
    head = STREAM_HEAD.replace(b"transfer-encoding: chunked", b"Transfer-Encoding: Chunked")
    cut = [head + chunked(b"data: 1\n\n")[: -len(b"0\r\n\r\n")], None]  # a chunked body cut off
    early = [b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + STREAM_HEAD, chunked(b"data: 2\n")]

    async def main():
        async with Server([cut]) as base, sc.StreamClient() as client:
            with pytest.raises(ConnectionError):  # not taken for a body that ends at the close
                await client.post_lines(base + "/x", {}, lambda *_: False)
        async with Server([early]) as base, sc.StreamClient() as client:
            got = []
            await client.post_lines(base + "/x", {}, into(got))
        return got

    assert asyncio.run(main()) == ["data: 2"]
