"""Core lists and the split between an engine process's cores and the serving path's."""

from __future__ import annotations

import os
import threading

import pytest

from serve_app.placement import bind_process, format_cpus, parse_cpus, serving_cores


@pytest.mark.parametrize(
    "text, cores",
    [("", ()), ("1", (1,)), ("0-3", (0, 1, 2, 3)), ("4-5, 0,2", (0, 2, 4, 5)), ("1,1", (1,))],
)
def test_parse(text, cores):
    assert parse_cpus(text) == cores
    assert parse_cpus(format_cpus(cores)) == cores


@pytest.mark.parametrize("text, part", [("a", "'a'"), ("3-1", "'3-1'"), ("-2", "'-2'")])
def test_parse_errors_name_the_part(text, part):
    with pytest.raises(ValueError, match=part):
        parse_cpus(text)


def test_serving_cores_are_the_rest():
    here = os.sched_getaffinity(0)
    first = min(here)
    assert serving_cores(()) is None  # no engine bound: no binding
    assert serving_cores(here) is None  # nothing left over
    if len(here) > 1:
        assert serving_cores({first}) == here - {first}


def test_bind_process_moves_every_thread_and_later_ones():
    here = os.sched_getaffinity(0)
    seen: dict[str, set] = {}
    started, go = threading.Event(), threading.Event()

    def worker(name: str) -> None:
        started.set()
        go.wait(5)
        seen[name] = os.sched_getaffinity(0)

    early = threading.Thread(target=worker, args=("early",))
    early.start()
    started.wait(5)
    try:
        bind_process({min(here)})
        late = threading.Thread(target=worker, args=("late",))
        late.start()
        go.set()
        early.join()
        late.join()
        assert seen == {"early": {min(here)}, "late": {min(here)}}
        with pytest.raises(ValueError, match="not available here"):
            bind_process({4096})
        bind_process(None)  # nothing to bind to: left as it is
        assert os.sched_getaffinity(0) == {min(here)}
    finally:
        bind_process(here)
