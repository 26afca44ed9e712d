"""`MicroBatcher`: concurrent calls gathered into batches, run one at a time off the event loop.

An encoder's forward pass costs about the same for one short input as for a few dozen (the
weights are read once per pass), so many small concurrent requests are much cheaper served
together. There is no timer: a batch starts as soon as the worker is free, with everything that
is waiting, up to `max_size`; what arrives while it runs goes into the next one. An idle server
thus adds no latency, and a busy one batches by itself.

Plain asyncio (no Ray), so the embedding deployment and its tests share it. A caller that goes
away (its task cancelled) before its batch starts is left out of it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """run(items) -> one result per item, in order; it runs on a worker thread, one batch at a
    time. size_of(item) is what counts towards max_size (e.g. the inputs of a request); an item
    larger than max_size still runs, alone. An exception from `run` fails every call of that
    batch."""

    def __init__(
        self,
        run: Callable[[list[T]], list[R]],
        max_size: int,
        size_of: Callable[[T], int] = lambda item: 1,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self._run = run
        self._max_size = max_size
        self._size_of = size_of
        self._pending: deque[tuple[T, asyncio.Future]] = deque()
        self._worker: asyncio.Task | None = None
        self.num_batches = 0  # batches run so far
        self.num_items = 0  # items in them

    async def submit(self, item: T) -> R:
        """The result of `run` for this item, once a batch holding it has run."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((item, future))
        if self._worker is None:
            self._worker = loop.create_task(self._drain())
        return await future  # cancelling the caller cancels the future: it is then skipped

    def _take(self) -> list[tuple[T, asyncio.Future]]:
        batch: list[tuple[T, asyncio.Future]] = []
        size = 0
        while self._pending:
            item, future = self._pending[0]
            if future.done():  # its caller went away
                self._pending.popleft()
                continue
            n = self._size_of(item)
            if batch and size + n > self._max_size:
                break
            batch.append(self._pending.popleft())
            size += n
        return batch

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch = self._take()
                if not batch:
                    continue
                try:
                    results = await asyncio.to_thread(self._run, [item for item, _ in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"{len(results)} results for {len(batch)} items")
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:  # the worker itself cancelled (the loop shutting down)
                    for _, future in [*batch, *self._pending]:
                        future.cancel()
                    self._pending.clear()
                    raise
                self.num_batches += 1
                self.num_items += len(batch)
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._worker = None
