"""The engine for serving: the step loop on a thread of its own, requests as async iterators.

Adding and aborting requests from the event loop goes through an inbox that the loop thread
drains before each step, so the engine itself stays single-threaded. A step's outputs go back
to each event loop in one `call_soon_threadsafe` (one wake-up per step, not one per request),
which puts each into its request's queue. `generate_batches` hands a consumer everything its
request has queued at once: a consumer slower than the engine gets the tokens of several steps
together, while one that keeps up gets every step's output as soon as it exists.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.outputs import RequestOutput


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs as they come; the last one has `finished`. Leaving early aborts the request."""
        async with aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_batches(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        """Like `generate`, but each item is every output queued for the request when the
        consumer asks (at least one, in step order): never waits for more to arrive."""
        loop = asyncio.get_running_loop()
        if request.arrival_time is None:
            request.arrival_time = time.monotonic()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (loop, outputs)
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                batch = [await outputs.get()]
                while not outputs.empty():
                    batch.append(outputs.get_nowait())
                for i, item in enumerate(batch):
                    if isinstance(item, Exception):
                        if i:  # what came before the failure first; the failure next time
                            outputs.put_nowait(item)
                            batch = batch[:i]
                            break
                        raise item
                    finished = item.finished
                    if finished:
                        del batch[i + 1 :]
                        break
                yield batch
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    @property
    def is_running(self) -> bool:
        """The step loop's thread is alive (a health check replaces a replica whose is not)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def stats(self) -> dict:
        return self.engine.stats()

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Each (request id, output or exception) to its request's queue: one hand-over per
        event loop for the lot."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, outputs = target
                by_loop.setdefault(loop, []).append((outputs, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            else:
                output = self.engine.abort(payload)
                if output is not None:
                    self._deliver(payload, output)

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except RequestRejected as exc:
            self._deliver(request.request_id, exc)
            return
        except Exception as exc:  # e.g. a malformed handed-over generator state: this request
            # fails, the loop (and every other request) goes on
            self._deliver(request.request_id, EngineError(f"the engine could not add it: {exc!r}"))
            return
        if request.imported is not None:
            # The engine keeps the KV payload only until it is written into the pool; the
            # request object lives as long as its stream and must not hold the host copy.
            request.imported.kv = None

    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    self._deliver(request_id, EngineError(f"engine step failed: {exc!r}"))
                continue
            self._deliver_all([(output.request_id, output) for output in outputs])


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in puts:
        outputs.put_nowait(item)
