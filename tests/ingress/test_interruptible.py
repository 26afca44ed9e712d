"""Interruptible: a stream's items on demand, a wait a stop or a deadline ends at once."""

from __future__ import annotations

import asyncio
import functools

import pytest

from serve_app.ingress.interruptible import END, INTERRUPTED, Interruptible


def in_loop(test):
    @functools.wraps(test)
    def run():
        asyncio.run(test())

    return run


class Source:
    """An async generator over a queue that records how often it was asked and how it ended."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.asked = 0
        self.ended: str | None = None

    async def items(self):
        try:
            while True:
                self.asked += 1
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    self.ended = "exhausted"
                    return
                yield item
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        except GeneratorExit:
            self.ended = "closed"
            raise


async def pending_wait() -> tuple[Source, Interruptible, asyncio.Future]:
    """A consumer waiting for an item that has not come."""
    src = Source()
    chunks = Interruptible(src.items())
    waiting = asyncio.ensure_future(chunks.next())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    return src, chunks, waiting


@in_loop
async def test_items_in_order_then_end_and_never_read_ahead():
    src = Source()
    for item in ("a", "b", None):
        src.queue.put_nowait(item)
    chunks = Interruptible(src.items())
    await asyncio.sleep(0.01)
    assert src.asked == 0  # nothing is read before the consumer asks
    assert await chunks.next() == "a"
    await asyncio.sleep(0.01)
    assert src.asked == 1
    assert await chunks.next() == "b"
    assert await chunks.next() is END
    assert await chunks.next() is END
    await chunks.close()
    assert src.ended == "exhausted"


@in_loop
async def test_an_interrupt_ends_a_pending_wait_and_close_cancels_the_read():
    src, chunks, waiting = await pending_wait()
    chunks.interrupt()
    assert await asyncio.wait_for(waiting, 1) is INTERRUPTED
    assert await chunks.next() is INTERRUPTED  # it stays interrupted
    await chunks.close()
    assert src.ended == "cancelled"  # the replica stream sees its request abandoned


@in_loop
async def test_an_interrupt_between_items_ends_the_next_wait():
    src = Source()
    src.queue.put_nowait("a")
    chunks = Interruptible(src.items())
    assert await chunks.next() == "a"
    chunks.interrupt()
    assert await chunks.next() is INTERRUPTED
    await chunks.close()
    assert src.ended == "closed"  # never exhausted: closed, so its cleanup runs now


@in_loop
async def test_the_deadline_interrupts():
    src = Source()
    loop = asyncio.get_running_loop()
    chunks = Interruptible(src.items(), deadline=loop.time() + 0.05)
    started = loop.time()
    assert await asyncio.wait_for(chunks.next(), 2) is INTERRUPTED
    assert loop.time() - started >= 0.04
    await chunks.close()


@in_loop
async def test_the_deadline_timer_is_cancelled_by_close():
    src = Source()
    src.queue.put_nowait(None)
    chunks = Interruptible(src.items(), deadline=asyncio.get_running_loop().time() + 0.05)
    assert await chunks.next() is END
    await chunks.close()
    await asyncio.sleep(0.1)
    assert await chunks.next() is END


@in_loop
async def test_an_error_of_the_stream_raises_in_next():
    src = Source()
    src.queue.put_nowait("a")
    src.queue.put_nowait(ValueError("boom"))
    chunks = Interruptible(src.items())
    assert await chunks.next() == "a"
    with pytest.raises(ValueError, match="boom"):
        await chunks.next()
    assert await chunks.next() is END
    await chunks.close()


@in_loop
async def test_closing_the_consumer_mid_wait_cancels_the_read():
    """The client went away: the consumer task is cancelled while it waits for an item."""
    src, chunks, waiting = await pending_wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await chunks.close()
    assert src.ended == "cancelled"


@in_loop
async def test_no_task_of_its_own_the_consumers_task_reads():
    """One task switch per item, not two: the consumer's task awaits the stream itself."""
    src = Source()
    src.queue.put_nowait("a")
    before = len(asyncio.all_tasks())
    chunks = Interruptible(src.items())
    assert await chunks.next() == "a"
    assert len(asyncio.all_tasks()) == before
    await chunks.close()


@in_loop
async def test_an_interrupt_does_not_swallow_a_cancellation_from_elsewhere():
    """The client went away at the moment a stop came: the consumer still ends cancelled."""
    src, chunks, waiting = await pending_wait()
    waiting.cancel()
    chunks.interrupt()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await chunks.close()
    assert src.ended == "cancelled"


@in_loop
async def test_an_interrupt_as_the_item_arrives_still_interrupts():
    """The item came in the same turn of the loop as the stop: the wait ends INTERRUPTED and
    the consumer's task is not left with a cancellation pending."""
    src, chunks, waiting = await pending_wait()
    src.queue.put_nowait("late")
    chunks.interrupt()
    assert await asyncio.wait_for(waiting, 1) is INTERRUPTED
    assert waiting.cancelling() == 0  # the interrupt's cancellation was taken back
    await chunks.close()
