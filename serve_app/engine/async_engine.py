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
from dataclasses import dataclass

from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.kv_transfer import ImportedPrefill
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.outputs import RequestOutput
from serve_app.engine.params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 5
    deadline: float | None = None  # time.monotonic() deadline of this request
    export_kv: bool = False  # PD prefill: one token, then the prompt's KV on the final output
    imported: ImportedPrefill | None = None  # PD decode: continue another engine's prefill
    # When the request reached the engine's owner; stamped by generate() if unset, so that time
    # spent in the inbox behind a long running step counts as queueing, not as prefill.
    arrival_time: float | None = None
    e2e_start: float | None = None  # PD decode: when the e2eTimeout window began (prefill)


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

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
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
                try:
                    self._add(payload)
                except RequestRejected as exc:
                    self._deliver(payload.request_id, exc)
            else:
                output = self.engine.abort(payload)
                if output is not None:
                    self._deliver(payload, output)

    def _add(self, request: GenerateRequest) -> None:
        imported = request.imported
        if imported is None:
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                request.priority,
                request.deadline,
                export_kv=request.export_kv,
                arrival_time=request.arrival_time,
            )
            return
        self.engine.add_imported_request(
            request.request_id,
            request.prompt_token_ids,
            imported.first_token_id,
            request.params,
            imported.kv,
            imported.generator_state,
            imported.output_limit,
            request.priority,
            request.deadline,
            arrival_time=request.arrival_time,
            e2e_start=request.e2e_start,
        )
        imported.kv = None  # the engine holds it until it is in the pool; then nobody does

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
