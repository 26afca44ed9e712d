"""The engine for serving: the step loop on a thread of its own, requests as async iterators.

Adding and aborting requests from the event loop goes through an inbox that the loop thread
drains before each step, so the engine itself stays single-threaded. Outputs are handed back
to each request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator

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
        loop = asyncio.get_running_loop()
        if request.arrival_time is None:
            request.arrival_time = time.monotonic()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (loop, outputs)
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
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
        target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, item)

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
            for output in outputs:
                self._deliver(output.request_id, output)
