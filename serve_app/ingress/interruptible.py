"""A stream's items, one at a time, with a wait for the next that a stop or a deadline can end.

Racing each `anext()` against a stop event and a timeout with `asyncio.wait` costs a task, a
wait set and four callbacks per item, several times what a plain `async for` costs, on the
ingress's CPU for every streamed chunk (docs/performance.md, "The serving path's own lines and
streams"). A reader task that calls `anext()` for the consumer and hands each item over in a
future still cost a second task switch per item. Here the consumer's own task awaits `anext()`,
and the stop callback or the deadline's timer, when it fires during that wait, cancels the wait
(and so the stream, whose request is then abandoned): `next()` returns INTERRUPTED instead of
the cancellation. A cancellation from anywhere else (the client went away) is not swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

END = object()  # the stream is over
INTERRUPTED = object()  # the stop fired or the deadline passed; the stream stays unfinished


class Interruptible:
    """`upstream`'s items through `next()`; `interrupt()` (or `deadline`, on the loop's clock)
    makes a pending or later `next()` return INTERRUPTED. `close()` closes the stream."""

    def __init__(self, upstream: AsyncIterator[Any], deadline: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._upstream = upstream
        self._waiter: asyncio.Task | None = None  # the task in next(), while it waits
        self._cancelled = False  # interrupt() cancelled that wait
        self._interrupted = False
        self._finished = False
        self._timer = None if deadline is None else loop.call_at(deadline, self.interrupt)

    def interrupt(self, *_: Any) -> None:
        self._interrupted = True
        if self._waiter is not None and not self._cancelled:
            self._cancelled = True
            self._waiter.cancel()

    async def next(self) -> Any:
        """The next item, END, or INTERRUPTED. Errors of the stream raise here."""
        if self._interrupted:
            return INTERRUPTED
        if self._finished:
            return END
        self._waiter = task = asyncio.current_task()
        try:
            item = await anext(self._upstream)
        except StopAsyncIteration:
            self._finished = True
            return END
        except asyncio.CancelledError:
            self._finished = True  # the stream saw the cancellation: it is over
            if self._cancelled and task.uncancel() == 0:
                return INTERRUPTED  # ours alone
            raise
        except BaseException:
            self._finished = True
            raise
        finally:
            self._waiter = None
        if self._cancelled:  # the stream gave an item despite the cancel: it is ours to undo
            task.uncancel()
            return INTERRUPTED
        return item

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(BaseException):
            await self._upstream.aclose()
