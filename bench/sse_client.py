"""bench/serve.py's HTTP client: HTTP/1.1 keep-alive connections as asyncio protocols over
httptools' C parser (the one uvicorn serves with), a streamed body's lines handed to a callback.

A load generator on the server's own cores takes from the server what it spends itself. Against
a bare uvicorn stream (bench/sse_floor.py, 32 streams, one chunk per 15 ms each) aiohttp's
response object, stream reader and line iterator cost ~40 us of the client's CPU per chunk on a
2-core machine of docs/benchmarks.md (~34 on uvloop); this client ~14-20, most of it the JSON of
each event.
`http://` and `https://` URLs; no proxies, redirects or compression (a load generator needs none).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

LineHandler = Callable[[str, float], bool]  # (line, arrival time) -> True once the stream is over


class HTTPStatusError(Exception):
    """A response other than 200; `body` is its first bytes."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class ProtocolError(ConnectionError):
    """The server's bytes are not an HTTP/1.1 response."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time: a 200's body goes line by line to
    `on_line` (or is collected when there is none), any other status's body is collected.
    `done` resolves when the response is over, or as soon as on_line says the stream is; the
    rest of such a response is still read, and `on_idle` is called once it has been."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.begin(None)

    def begin(self, on_line: LineHandler | None) -> asyncio.Future:
        self.on_line = on_line
        self.on_idle: Callable[[_Connection], None] | None = None  # set by a drained request
        self.status = 0
        self.keep_alive = True
        self.complete = False  # the whole response was read: the connection can be reused
        self.framed = False  # a length or chunks: else the body runs until the server closes
        self.stopped = False  # on_line said the stream is over: the rest is not looked at
        self.error: BaseException | None = None  # what on_line raised
        self.body = b""  # collected (or the last line, still incomplete)
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # on_line's errors come wrapped in one too
            self._fail(self.error or ProtocolError(f"malformed response: {exc}"))
            self.close()  # the parser's state is lost: the connection cannot serve again

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self.status and not self.framed and not self.complete:
            try:  # the close is what ends such a body
                self.on_message_complete()
            except Exception as error:  # noqa: BLE001 - on_line's, on the last line
                self._fail(error)
        self._fail(exc or ConnectionError("the server closed the connection mid-response"))

    # -- httptools callbacks --------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (
            name == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.on_line is None or self.status != 200:
            self.body += body
            return
        if self.stopped:
            return
        now = time.perf_counter()
        lines = (self.body + body if self.body else body).split(b"\n")
        self.body = lines.pop()
        for line in lines:
            if self._line(line, now):
                return

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200:  # an interim response (103 Early Hints): the real one follows
            self.status, self.framed = 0, False
            return
        self.complete = True
        if self.on_line is not None and self.status == 200 and self.body and not self.stopped:
            self._line(self.body, time.perf_counter())
        self._finish()
        if self.on_idle is not None and self.keep_alive and not self.closed:
            self.on_idle(self)

    def _line(self, line: bytes, now: float) -> bool:
        try:
            self.stopped = bool(self.on_line(line.decode(), now))
        except Exception as exc:
            self.error = exc
            raise
        if self.stopped:
            self._finish()
        return self.stopped

    def _finish(self) -> None:
        if not self.done.done():
            if self.status == 200:
                self.done.set_result(self.body if self.on_line is None else b"")
            else:
                self.done.set_exception(HTTPStatusError(self.status, self.body))

    def _fail(self, exc: BaseException) -> None:
        self.keep_alive = False
        if not self.done.done():
            self.done.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class StreamClient:
    """Requests to any number of servers over pooled keep-alive connections; `async with` closes
    them all. Cancelling a request closes its connection (the rest of its body is never read)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    async def post_lines(self, url: str, payload: Any, on_line: LineHandler) -> None:
        """POSTs `payload` as JSON and feeds the lines of a 200's body to on_line as they
        arrive (without their b"\\n"; a b"\\r" before it is kept). Returns when the body ends
        or on_line returned True (the rest of the body is then read in the background, and the
        connection reused after it). HTTPStatusError for any other status; OSError
        (ConnectionError, ProtocolError) when the connection fails; on_line's own exceptions
        are raised here."""
        body = json.dumps(payload).encode()
        await self._request("POST", url, body, on_line)

    async def get_json(self, url: str) -> Any:
        """GET's JSON body (HTTPStatusError for a status other than 200)."""
        return json.loads(await self._request("GET", url, b"", None))

    async def _request(
        self, method: str, url: str, body: bytes, on_line: LineHandler | None
    ) -> bytes:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream, application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        conn = await self._connection(key)
        outcome = "close"
        try:
            done = conn.begin(on_line)
            conn.transport.write(head + body)
            result = await done
            if conn.keep_alive and not conn.closed:
                outcome = "idle" if conn.complete else "drain"
            return result
        finally:
            if outcome == "idle":
                self._idle.setdefault(key, []).append(conn)
            elif outcome == "drain":  # ended by on_line: pooled once the rest has been read
                conn.on_idle = lambda c: self._idle.setdefault(key, []).append(c)
            else:  # failed, cancelled, or the server closes it
                self._open.discard(conn)
                conn.close()

    async def _connection(self, key: tuple[str, str, int]) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._open.discard(conn)
        scheme, host, port = key
        tls = None
        if scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, host, port, ssl=tls)
        self._open.add(conn)
        return conn

    def close(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()
