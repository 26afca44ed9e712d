"""A request's engine outputs straight onto its ingress's token socket, in the step's hand-over.

Streaming through the socket (`outbox.py`), a request's coroutine used to wake for every
engine step only to turn the step's output into a chunk and put it on the link: at 32 streams,
32 coroutine wake-ups, queue hand-overs and async-generator resumptions per step on the model
replica's event loop. A `Relay` does that work in the function the engine calls with each output
(`AsyncEngine.feeding`), so the request's coroutine sleeps until the request is over: `final`
resolves with the chunk that ends it (the engine finished it, every choice hit a stop string,
an error, the link closed), which the caller sends itself.
"""

from __future__ import annotations

import asyncio

from serve_app.disagg.handoff import Handoff
from serve_app.engine.outputs import RequestOutput
from serve_app.messages import ErrorKind, ReplicaChunk
from serve_app.replica.output_processor import OutputProcessor
from serve_app.token_socket.outbox import Link

SOCKET_CLOSED = "the token socket to the ingress closed"


class Relay:
    def __init__(
        self, processor: OutputProcessor, link: Link, handoff: Handoff | None = None
    ) -> None:
        self.processor = processor
        self.link = link
        self.handoff = handoff
        self.final: asyncio.Future[ReplicaChunk] = asyncio.get_running_loop().create_future()

    def take(self, item: RequestOutput | Exception) -> None:
        """One engine output (or the failure that ends the request); never raises."""
        if self.final.done():  # over already (a stop string): later outputs are dropped
            return
        processor = self.processor
        try:
            if isinstance(item, Exception):
                raise item
            chunk = chunk_of(processor, [item], self.handoff)
            # the ingress's side closed: noticed at every output, also while chunks are held
            if not self.link.alive:
                chunk = processor.error_chunk(ErrorKind.ENGINE, SOCKET_CLOSED)
            elif chunk is None:
                return
        except Exception as exc:  # an engine refusal or failure, or a bug here
            chunk = processor.failure_chunk(exc)
        if chunk.finished:
            self.final.set_result(chunk)
        else:
            self.link.put(chunk)


def chunk_of(
    processor: OutputProcessor, outputs: list[RequestOutput], handoff: Handoff | None
) -> ReplicaChunk | None:
    """The chunk for consecutive engine outputs of one request (None: nothing to send yet),
    with a PD decode's hand-off facts on its first chunk."""
    if handoff is not None:
        handoff.note_import(outputs)
    chunk = processor.process_all(outputs)
    if chunk is not None and handoff is not None:
        handoff.stamp(chunk)
    return chunk
