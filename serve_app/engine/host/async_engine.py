"""The engine for serving: the step loop on a thread or in a process of its own, requests as
async iterators.

The step loop runs on a host: a thread of this process (`thread.EngineThread`) or, with
`engine_process`, a child process of its own (`process.EngineProcess`); both take the same
messages (add, abort, stop) and hand back each step's outputs, which go to each event loop in
one `call_soon_threadsafe` (one wake-up per step, not one per request), which puts each into its
request's queue.
`generate_batches` hands a consumer everything its request has queued at once: a consumer slower
than the engine gets the tokens of several steps together, while one that keeps up gets every
step's output as soon as it exists. `feeding` hands each output to a plain function instead, in
that same hand-over: no queue and no coroutine to wake per output, for a consumer whose work
per output is synchronous.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import TYPE_CHECKING

from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.host.process import EngineInfo, EngineProcess
from serve_app.engine.host.thread import EngineThread
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.outputs import RequestOutput

if TYPE_CHECKING:  # with the step loop in a child process, this one imports no model code
    from serve_app.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        """config.engine_process: the step loop in a child process; otherwise (or when an
        `engine` is given) on a thread of this process, and `self.engine` is that engine."""
        config = engine.config if engine is not None else (config or EngineConfig())
        self.config = config
        # request id -> (its event loop, what takes its outputs there, its prompt ids)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Callable, list[int]]] = {}
        self._last_output = time.monotonic()  # when the engine last handed over outputs
        self._failure: str | None = None  # set by fail()
        self.engine: LLMEngine | None = None  # the in-process engine (thread mode)
        self._host: EngineProcess | EngineThread
        if engine is None and config.engine_process:
            # the child's torch threads: its bound cores, else what this process was given: its
            # torch's count where it has torch loaded (it may have set it), else what the child
            # reads from the same environment (OMP_NUM_THREADS, which Ray sets). A model
            # replica does not load torch before the child starts: ~1.5 s sooner on 2 cores.
            torch = sys.modules.get("torch")
            threads = torch.get_num_threads() if torch is not None else None
            self._host = EngineProcess(config, self._deliver_all, self._fail_all, threads)
            self._tokenizer = self._host.tokenizer  # loaded while the child loaded the model
        else:
            if engine is None:
                from serve_app.engine.llm_engine import LLMEngine

                engine = LLMEngine(config)
            self.engine = engine
            self._tokenizer = engine.tokenizer
            self._host = EngineThread(engine, self._deliver_all, self._fail_all)
        self.info: EngineInfo = self._host.info

    @property
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs as they come; the last one has `finished`. Leaving early aborts the request."""
        async with aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_batches(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        """Like `generate`, but each item is every output queued for the request when the
        consumer asks (at least one, in step order): never waits for more to arrive. The queue
        is what `feeding` hands the outputs to."""
        outputs: asyncio.Queue = asyncio.Queue()
        with self.feeding(request, outputs.put_nowait):
            finished = False
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

    @contextmanager
    def feeding(
        self, request: EngineRequest, take: Callable[[RequestOutput | Exception], None]
    ) -> Iterator[None]:
        """Runs `request` while the block runs: each output (or the exception that ends it, an
        engine refusal or failure) goes to `take` on this event loop, in step order, as the step
        hands it over. `take` must not raise, nor block. Leaving the block before the engine
        finished the request aborts it (and frees its blocks)."""
        over = False

        def take_and_note(item: RequestOutput | Exception) -> None:
            nonlocal over
            over = over or isinstance(item, Exception) or item.finished
            take(item)

        if request.request_id in self._streams:  # refused here: the engine's refusal would
            # go to the stream registered under that id, the other request's
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if request.arrival_time is None:
            request.arrival_time = time.monotonic()
        loop = asyncio.get_running_loop()
        if not self._streams:  # work after a quiet spell: the watchdog counts from here
            self._last_output = time.monotonic()
        self._streams[request.request_id] = (loop, take_and_note, request.prompt_token_ids)
        self._send(("add", request))
        try:
            yield
        finally:
            self._streams.pop(request.request_id, None)
            if not over:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    @property
    def is_running(self) -> bool:
        """The step loop is alive and not failed (a health check replaces a replica whose is
        not)."""
        return self._failure is None and self._host.is_running

    @property
    def failure(self) -> str | None:
        """What fail() was given (None: not failed)."""
        return self._failure

    def fail(self, message: str) -> None:
        """For an engine that cannot go on though its loop looks alive (a rank of the model
        hangs, so the step waits forever): every open stream ends with message, and every
        request after it too."""
        self._failure = message
        self._fail_all(message)

    def stalled_s(self) -> float:
        """Seconds the engine has handed over no output while requests wait for one: a step
        that never returns (a device call that hangs) shows here, as the loop itself looks
        alive. 0 while no request is in flight."""
        return time.monotonic() - self._last_output if self._streams else 0.0

    def shutdown(self) -> None:
        self._host.shutdown()

    def stats(self) -> dict:
        """The engine's counters: as of its last step when it runs in a process."""
        return self._host.stats()

    def _send(self, message) -> None:
        if message[0] == "add" and not self.is_running:
            why = self._failure or "the engine is not running"
            self._deliver_all([(message[1].request_id, EngineError(why))])
            return
        self._host.send(message)

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Each (request id, output or exception) to what takes its request's outputs: one
        hand-over per event loop for the lot. Outputs from the engine process come without the
        prompt ids."""
        self._last_output = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, take, prompt = target
                if isinstance(item, RequestOutput) and item.prompt_token_ids is None:
                    item.prompt_token_ids = prompt
                by_loop.setdefault(loop, []).append((take, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _fail_all(self, message: str) -> None:
        """The engine process died: every open stream ends with that failure."""
        failures = [(request_id, EngineError(message)) for request_id in list(self._streams)]
        self._deliver_all(failures)


def _put_all(puts: list[tuple[Callable, object]]) -> None:
    for take, item in puts:
        try:
            take(item)
        except Exception:  # one consumer's bug must not keep the step's outputs from the rest
            logger.exception("handing an engine output to its consumer failed")
