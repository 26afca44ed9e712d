"""A request's engine outputs, made into chunks in the step's hand-over, onto its sink.

A replica streams a request's chunks to one of two sinks with one interface (`Sink`): the
ingress's token socket (`token_socket.outbox.Link`) when it can reach it, else the request's own
Ray stream (`RayStream`), which the replica's generator yields from. Either way a `Relay` does
the work in the function the engine calls with each output (`AsyncEngine.feeding`): a request's
coroutine that woke for every engine step only to turn its output into a chunk cost, at 32
streams, 32 wake-ups, queue hand-overs and generator resumptions per step on the replica's event
loop. `final` resolves with the chunk that ends the request (the engine finished it, every
choice hit a stop string, an error, the socket closed), which the caller sends itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from serve_app.disagg.handoff import Handoff
from serve_app.engine.outputs import RequestOutput
from serve_app.messages import ErrorKind, ReplicaChunk
from serve_app.replica.output_processor import OutputProcessor

SOCKET_CLOSED = "the token socket to the ingress closed"


class Sink(Protocol):
    """Where a request's chunks go. `put` never waits: chunks put while the consumer has not
    taken earlier ones fold into them (never waits for tokens, only keeps a slow consumer from
    falling behind); `now` sends at once, and what is put next is not folded into it."""

    alive: bool  # False once the consumer is gone (the ingress closed its socket)

    def put(self, chunk: ReplicaChunk, now: bool = False) -> None: ...

    async def drain(self) -> None:
        """Waits (bounded) until what was put is on its way."""

    def yielded(self, final: asyncio.Future | None) -> AsyncIterator[ReplicaChunk]:
        """The chunks the replica's generator must yield itself (none for a socket: it sends
        them), until `final` resolves and none is left; with None, only those put so far."""


class RayStream:
    """The request's Ray stream as a sink: the replica's generator yields what is put."""

    alive = True

    def __init__(self) -> None:
        self._chunks: list[ReplicaChunk] = []
        self._sealed = False  # the last chunk was put with now=True: nothing folds into it
        self._wake = asyncio.Event()

    def put(self, chunk: ReplicaChunk, now: bool = False) -> None:
        if self._chunks and not self._sealed:
            self._chunks[-1].absorb(chunk)
        else:
            self._chunks.append(chunk)
        self._sealed = now
        self._wake.set()

    async def drain(self) -> None:
        return

    async def yielded(self, final: asyncio.Future | None) -> AsyncIterator[ReplicaChunk]:
        if final is not None:
            final.add_done_callback(lambda _: self._wake.set())
        while True:
            chunks, self._chunks, self._sealed = self._chunks, [], False
            for chunk in chunks:
                yield chunk
            if self._chunks:  # put while the consumer took those
                continue
            if final is None or final.done():
                return
            self._wake.clear()
            await self._wake.wait()


class Relay:
    def __init__(
        self,
        processor: OutputProcessor,
        sink: Sink,
        handoff: Handoff | None = None,
        note: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.processor = processor
        self.sink = sink
        self.handoff = handoff
        self.note = note  # told of each output (the replica's metrics)
        self.final: asyncio.Future[ReplicaChunk] = asyncio.get_running_loop().create_future()

    def take(self, item: RequestOutput | Exception) -> None:
        """One engine output (or the failure that ends the request); never raises."""
        if self.final.done():  # over already (a stop string): later outputs are dropped
            return
        processor = self.processor
        try:
            if isinstance(item, Exception):
                raise item
            if self.note is not None:
                self.note(item)
            handoff = self.handoff
            if handoff is not None:
                handoff.note_import([item])
            chunk = processor.process(item)
            if chunk is not None and handoff is not None:
                handoff.stamp(chunk)  # a PD decode's hand-off facts, on its first chunk
            # the ingress's side closed: noticed at every output, also while chunks are held
            if not self.sink.alive:
                chunk = processor.error_chunk(ErrorKind.ENGINE, SOCKET_CLOSED)
            elif chunk is None:
                return
        except Exception as exc:  # an engine refusal or failure, or a bug here
            chunk = processor.failure_chunk(exc)
        if chunk.finished:
            self.final.set_result(chunk)
        else:
            self.sink.put(chunk)
