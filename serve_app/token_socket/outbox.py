"""A model replica's side of the ingress token sockets (`token_socket/inbox.py`).

A request whose `reply_to` names an ingress on this replica's node (or, with tokenStream "tcp",
on any node) gets a `Link` to that ingress's socket (one connection per ingress, opened by the
first such request). Its chunks are
`put` on the link instead of being yielded through Ray; the link writes everything put during one
turn of the event loop as one message, so the chunks that one engine step gives this ingress's
requests (made in the step's one hand-over) travel together; chunks of one request put in the same
turn (the event loop fell behind the engine) travel as one. A link that
cannot be opened is tried again after RETRY_S; meanwhile requests stream through Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import time
from collections.abc import AsyncIterator, Callable

from serve_app.messages import ReplicaChunk, StreamAddress
from serve_app.token_socket.frame import TOKEN_FRAME, pack_chunks

logger = logging.getLogger(__name__)

RETRY_S = 30.0  # after a failed connect, stream through Ray this long before trying again
CONNECT_S = 2.0  # a connect that takes longer (a firewall dropping packets) counts as failed
DRAIN_S = 5.0  # how long a request's last chunk may wait for the socket to take it


class Link:
    """One connection to one ingress's token socket. `on_close` runs once it is closed."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_close: Callable[[Link], None] = lambda link: None,
    ) -> None:
        self._writer = writer
        self._pending: dict[str, ReplicaChunk] = {}  # by request id, in the order put
        self._scheduled = False
        self.alive = True
        self._on_close = on_close
        self._closed = asyncio.ensure_future(self._watch(reader))

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """The ingress never writes: end of file means it closed the connection."""
        try:
            await reader.read()
        except Exception:  # noqa: BLE001 - any failure of the connection closes the link
            pass
        self.alive = False
        self._writer.close()  # not only half-closed: the socket is released
        self._on_close(self)

    async def drain(self) -> None:
        """Waits (at most DRAIN_S) until the socket has taken what was written: a request's
        final chunk is on its way before the request's Ray stream ends."""
        if self.alive:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer.drain(), DRAIN_S)

    async def yielded(self, final: asyncio.Future | None) -> AsyncIterator[ReplicaChunk]:
        """None: the socket sends every chunk put (`replica.relay.Sink`); waits for `final`."""
        if final is not None:
            await final
        return
        yield  # (an async generator that yields nothing)

    def put(self, chunk: ReplicaChunk, now: bool = False) -> None:
        """Sends chunk with the others put in this turn of the event loop (folded into an
        earlier one of its request not sent yet); `now` sends them at once (a request's final
        chunk, before its Ray stream ends)."""
        earlier = self._pending.get(chunk.request_id)
        if earlier is None:
            self._pending[chunk.request_id] = chunk
        else:
            earlier.absorb(chunk)
        if now:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        chunks, self._pending = self._pending, {}
        if not chunks or not self.alive:
            return
        try:
            data = pickle.dumps(pack_chunks(list(chunks.values())), pickle.HIGHEST_PROTOCOL)
            self._writer.write(TOKEN_FRAME.pack(len(data)) + data)
        except Exception:
            logger.exception("token socket: writing to the ingress failed")
            self.close()

    def close(self) -> None:
        self.alive = False
        self._closed.cancel()
        self._writer.close()
        self._on_close(self)


class TokenOutbox:
    """The links of one replica, by ingress socket path."""

    def __init__(self, node_id: str | None) -> None:
        self.node_id = node_id
        self._links: dict[str, asyncio.Future] = {}
        self._refused: dict[str, float] = {}  # path -> when a connect last failed

    async def link(self, address: StreamAddress | None) -> Link | None:
        """The link to `address`, connected on first use; None when the request should stream
        through Ray (no address, another node without the TCP socket, or the socket cannot be
        reached)."""
        if address is None:
            return None
        if address.node_id is not None and address.node_id == self.node_id:
            path = address.path  # the Unix socket
        elif address.port is not None:
            path = f"{address.host}:{address.port}"
        else:
            return None
        if time.monotonic() - self._refused.get(path, -RETRY_S) < RETRY_S:
            return None
        pending = self._links.get(path)
        if pending is not None and pending.get_loop() is not asyncio.get_running_loop():
            pending = None  # made on another event loop (tests run one per asyncio.run)
        if pending is not None and pending.done():
            link = pending.result()
            if link is not None and link.alive:
                return link
            pending = None
        if pending is None:
            pending = self._links[path] = asyncio.ensure_future(self._connect(address, path))
        return await asyncio.shield(pending)

    async def _connect(self, address: StreamAddress, path: str) -> Link | None:
        try:
            if path == address.path:
                connect = asyncio.open_unix_connection(path)
            else:
                connect = asyncio.open_connection(address.host, address.port)
            reader, writer = await asyncio.wait_for(connect, CONNECT_S)
            if path != address.path:
                _keep_alive(writer)
            writer.write(address.secret)
        except (OSError, TimeoutError) as exc:
            logger.warning(
                "token socket %s unreachable (%r): streaming through Ray for %.0f s",
                path, exc, RETRY_S,
            )  # fmt: skip
            self._refused[path] = time.monotonic()
            return None

        def forget(link: Link) -> None:  # a closed link's entry goes (its ingress may be gone)
            pending = self._links.get(path)
            if pending is not None and pending.done() and not pending.cancelled():
                if pending.result() is link:
                    del self._links[path]

        return Link(reader, writer, forget)

    def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        self._refused.clear()
        for pending in links:
            try:
                if not pending.done():
                    pending.cancel()
                elif not pending.cancelled() and pending.result() is not None:
                    pending.result().close()
            except Exception:  # noqa: BLE001 - at shutdown the event loop may be gone already
                pass


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive probes after 10 s of silence, every 5 s, 3 unanswered: a dead ingress node
    closes the link within ~25 s, so its requests end and free their KV blocks."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def ray_node_id() -> str | None:
    """The Ray node this process runs on, when it runs under Ray (None otherwise)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not under Ray
        return None
