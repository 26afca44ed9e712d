"""The ingress's token socket: one message per engine step from a replica, not one per stream.

Through a Ray Serve handle every chunk of every streamed request is a Ray message of its own (at
32 streams, 32 messages per engine step, each serialized, reported and received by Ray's core
worker on both sides). A request still goes to its model replica through the handle (routing,
cancellation, a replica's death stay Ray Serve's), but it carries this inbox's address
(`StreamAddress`): a replica on the same node connects to it once and from then on writes, per
engine step, the chunks of all the requests it runs for this ingress as one length-prefixed
pickle (`token_socket/outbox.py`), which this side fans out to the requests' queues. A request
whose consumer fell behind gets what waits in its queue as one chunk. Such a
request's Ray stream yields nothing and ends once its final chunk is written; a replica on
another node, or one that cannot connect, yields its chunks through Ray as before, and the
request reads them from the same queue.

The socket is a Unix socket in a directory only this user can enter; a connection must first
send the inbox's random secret, which only requests sent by this ingress carry, before anything
it sends is unpickled.
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import logging
import os
import pickle
import secrets
import shutil
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.messages import ReplicaChunk, ReplicaRequest, StreamAddress
from serve_app.token_socket.frame import TOKEN_FRAME, unpack_chunks

logger = logging.getLogger(__name__)

SECRET_BYTES = 16
# After a request's Ray stream ended, how long its final chunk may take to come through the
# socket: the replica writes it before its stream ends, so this is only a guard against a lost one.
LAST_CHUNK_S = 10.0
SECRET_WAIT_S = 5.0  # a connection that has not sent the secret by then is closed

_END = object()  # the request's Ray stream ended (its chunks came, or come, through the socket)
_LOST = object()  # the connection that carried the request's chunks closed before its last


class TokenStreamLost(ConnectionError):
    """The socket that carried a request's chunks closed before its final chunk."""


class TokenInbox:
    """One per ingress process. `stream` runs one request through it."""

    def __init__(self, node_id: str | None, tcp_host: str | None = None) -> None:
        """node_id: the Ray node of this ingress (replicas there connect to the Unix socket).
        tcp_host: also listen on this address for replicas on other nodes (tokenStream tcp)."""
        self.node_id = node_id
        self.tcp_host = tcp_host
        self._queues: dict[str, Mailbox] = {}
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._starting: asyncio.Future | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._dir: str | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        # the connection that carries each running request's chunks, once one came through it
        self._carriers: dict[str, asyncio.StreamWriter] = {}
        self.num_frames = 0  # messages received from replicas
        self.num_chunks = 0  # chunks they carried

    async def address(self) -> StreamAddress | None:
        """The socket's address, listening from the first call on; None when it cannot listen
        (then requests stream through Ray)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> StreamAddress | None:
        try:
            self._dir = tempfile.mkdtemp(prefix="serve_app-tokens-")  # mode 0700
            # also when the process exits without the ingress's __del__ (Ray stopping it)
            atexit.register(shutil.rmtree, self._dir, True)
            path = os.path.join(self._dir, "inbox.sock")
            self._servers.append(await asyncio.start_unix_server(self._serve, path=path))
        except OSError as exc:
            logger.warning("no token socket (%s): replicas stream chunks through Ray", exc)
            return None
        address = StreamAddress(self.node_id, path, self._secret)
        if self.tcp_host is not None:
            try:
                server = await asyncio.start_server(self._serve, host=self.tcp_host, port=0)
            except OSError as exc:
                logger.warning(
                    "no TCP token socket on %s (%s): replicas on other nodes stream through Ray",
                    self.tcp_host, exc,
                )  # fmt: skip
            else:
                self._servers.append(server)
                address.host, address.port = self.tcp_host, server.sockets[0].getsockname()[1]
        return address

    async def stream(
        self, target: ReplicaRequest, send: Callable[[], Any]
    ) -> AsyncIterator[ReplicaChunk]:
        """The chunks of `target`, sent with `send()` (a Serve streaming response) after its
        `reply_to` is set. Leaving early cancels the request in the replica."""
        target.reply_to = await self.address()
        queue = Mailbox()
        self._queues[target.request_id] = queue
        response, watcher, done, ended = None, None, False, False
        held = None  # what came after chunks folded into one, for the next turn
        try:
            response = send()
            watcher = asyncio.ensure_future(_watch(response, queue))
            while True:
                if held is not None:
                    item, held = held, None
                elif ended:
                    try:
                        item = await asyncio.wait_for(queue.get(), LAST_CHUNK_S)
                    except TimeoutError:
                        raise TokenStreamLost(
                            "the replica ended the request without its final chunk"
                        ) from None
                else:
                    item = await queue.get()
                if item is _END:
                    ended = True
                    continue
                if item is _LOST:
                    raise TokenStreamLost("the replica's token stream closed mid-request")
                if isinstance(item, BaseException):
                    raise item
                # The consumer fell behind (the client, or this event loop): the chunks that
                # are waiting go out as one, never waiting for more (an error chunk stays
                # apart: the tokens before it are sent before the error is)
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if not isinstance(later, ReplicaChunk) or later.error is not None:
                        held = later
                        break
                    item.absorb(later)
                if item.finished:  # the request is over: forget it now, the caller may not
                    done = True  # close this generator after the last chunk
                    self._forget(target.request_id, watcher, linger=True)
                yield item
                if done:
                    return
        finally:
            if not done:  # left early (client gone, stopInfer, timeout): abort in the replica
                self._forget(target.request_id, watcher)
                if response is not None:
                    response.cancel()

    def _forget(
        self, request_id: str, watcher: asyncio.Future | None, linger: bool = False
    ) -> None:
        """linger: the request's final chunk came, and its Ray stream ends right after it:
        the watcher reads that end instead of cancelling the stream (cancelling a gRPC call
        while it is open costs both sides more CPU than reading its end: docs/performance.md,
        "The serving path's own lines and streams"), and is cancelled only if the end has not
        come within LAST_CHUNK_S."""
        self._queues.pop(request_id, None)
        self._carriers.pop(request_id, None)
        if watcher is None or watcher.done():
            return
        if linger:
            asyncio.get_running_loop().call_later(LAST_CHUNK_S, watcher.cancel)
        else:
            watcher.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One replica's connection: the secret, then lists of chunks until it closes."""
        self._connections.add(writer)
        try:
            secret = await asyncio.wait_for(reader.readexactly(SECRET_BYTES), SECRET_WAIT_S)
            if not hmac.compare_digest(secret, self._secret):
                logger.warning("token socket: a connection without the secret was closed")
                return
            while True:
                (size,) = TOKEN_FRAME.unpack(await reader.readexactly(TOKEN_FRAME.size))
                chunks = unpack_chunks(pickle.loads(await reader.readexactly(size)))
                self.num_frames += 1
                self.num_chunks += len(chunks)
                for chunk in chunks:
                    queue = self._queues.get(chunk.request_id)
                    if queue is None:  # already left (client gone): nothing waits for it
                        continue
                    queue.put_nowait(chunk)
                    self._carriers[chunk.request_id] = writer
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the replica closed the connection (stopped, died), or sent no secret in time
        except Exception:
            logger.exception("token socket: a replica's connection failed")
        finally:
            self._connections.discard(writer)
            writer.close()
            for request_id, carrier in list(self._carriers.items()):
                if carrier is writer and request_id in self._queues:
                    self._queues[request_id].put_nowait(_LOST)

    def close(self) -> None:
        """Stops listening and removes the socket's directory."""
        for server in self._servers:
            server.close()
        for writer in list(self._connections):
            writer.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class Mailbox:
    """A request's chunks on their way from the socket (or its Ray stream) to its reader: what
    an asyncio.Queue does for one reader and no size limit, without its bookkeeping for each
    chunk (getters and putters lists, unfinished-task counts)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


async def _watch(response: Any, queue: Mailbox) -> None:
    """Puts what the request's Ray stream yields (chunks from a replica that does not write to
    the socket), then _END, or the exception that ended it (a replica that died), into queue."""
    try:
        async for chunk in response:
            queue.put_nowait(chunk)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the request's reader
        queue.put_nowait(exc)
    else:
        queue.put_nowait(_END)
