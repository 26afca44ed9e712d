"""MicroBatcher (no model, no Ray): what waits together runs together, what arrives during a
batch waits for the next, sizes are capped, and failures and departed callers stay contained."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serve_app.embedding import MicroBatcher


class Recorder:
    """A run function that records its batches and can hold a batch until released."""

    def __init__(self, hold: bool = False) -> None:
        self.batches: list[list] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        self.started.set()
        self.release.wait(10)
        if "boom" in items:
            raise RuntimeError("boom")
        return [f"done {item}" for item in items]


def test_calls_waiting_together_share_one_batch_and_get_their_own_result():
    run = Recorder()

    async def main():
        batcher = MicroBatcher(run, max_size=8)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        return results, batcher

    results, batcher = asyncio.run(main())
    assert results == [f"done {i}" for i in range(5)]
    assert run.batches == [[0, 1, 2, 3, 4]]
    assert (batcher.num_batches, batcher.num_items) == (1, 5)


def test_calls_arriving_during_a_batch_go_into_the_next_one():
    run = Recorder(hold=True)

    async def main():
        batcher = MicroBatcher(run, max_size=8)
        first = asyncio.ensure_future(batcher.submit("a"))
        await asyncio.to_thread(run.started.wait, 10)  # "a" is running alone
        later = [asyncio.ensure_future(batcher.submit(x)) for x in "bcd"]
        while len(batcher._pending) < 3:  # b, c and d queued behind the running batch
            await asyncio.sleep(0)
        run.release.set()
        return await first, await asyncio.gather(*later)

    first, later = asyncio.run(main())
    assert first == "done a" and later == ["done b", "done c", "done d"]
    assert run.batches == [["a"], ["b", "c", "d"]]


def test_batches_hold_at_most_max_size_and_a_larger_item_runs_alone():
    run = Recorder()

    async def main():
        batcher = MicroBatcher(run, max_size=4, size_of=len)
        return await asyncio.gather(*(batcher.submit(s) for s in ["aa", "b", "c", "dddddd", "e"]))

    results = asyncio.run(main())
    assert results == ["done aa", "done b", "done c", "done dddddd", "done e"]
    assert run.batches == [["aa", "b", "c"], ["dddddd"], ["e"]]


def test_a_failed_batch_fails_its_calls_only():
    run = Recorder()

    async def main():
        batcher = MicroBatcher(run, max_size=2)
        return await asyncio.gather(
            *(batcher.submit(x) for x in ["x", "boom", "y"]), return_exceptions=True
        )

    first, second, third = asyncio.run(main())
    assert isinstance(first, RuntimeError) and isinstance(second, RuntimeError)
    assert third == "done y"


def test_a_caller_that_went_away_is_left_out_of_the_next_batch():
    run = Recorder(hold=True)

    async def main():
        batcher = MicroBatcher(run, max_size=8)
        first = asyncio.ensure_future(batcher.submit("a"))
        await asyncio.to_thread(run.started.wait, 10)
        gone = asyncio.ensure_future(batcher.submit("gone"))
        stays = asyncio.ensure_future(batcher.submit("stays"))
        await asyncio.sleep(0)
        gone.cancel()
        run.release.set()
        return await first, await stays

    assert asyncio.run(main()) == ("done a", "done stays")
    assert run.batches == [["a"], ["stays"]]


def test_max_size_must_be_positive():
    with pytest.raises(ValueError, match="max_size"):
        MicroBatcher(lambda items: items, max_size=0)


def test_the_embedding_package_needs_no_web_framework_ray_or_config():
    """Like the engine, serve_app.embedding is plain torch and asyncio: importing it (in a
    fresh interpreter) loads no fastapi, pydantic or ray, and nothing of the layers above it."""
    import subprocess
    import sys

    code = (
        "import sys, serve_app.embedding\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'pydantic', 'ray')\n"
        "       or m.startswith(('serve_app.config', 'serve_app.ingress', 'serve_app.replica',\n"
        "                        'serve_app.protocol', 'serve_app.messages'))]\n"
        "print(bad)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
