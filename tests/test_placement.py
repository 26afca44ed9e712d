"""Core lists and the split between an engine process's cores and the serving path's."""

from __future__ import annotations

import os
import threading

import pytest

from serve_app import placement
from serve_app.placement import (
    auto_cores,
    bind_process,
    format_cpus,
    node_cores,
    parse_cpus,
    resolve_cpus,
    serving_cores,
)


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


@pytest.mark.parametrize(
    "cores, engine, spare",
    [
        ([0], (), ()),  # one core: nothing to bind
        ([0, 1], (1,), (0,)),  # the 2-core machine: as deployments.yaml was tuned by hand
        (range(4), (1, 2, 3), (0,)),
        (range(16), tuple(range(2, 16)), (0, 1)),
        (range(64), tuple(range(8, 64)), tuple(range(8))),
        ([3, 5, 9], (5, 9), (3,)),  # the cores a container allows, not 0..n-1
    ],
)
def test_auto_leaves_the_serving_path_an_eighth_and_the_engine_the_rest(cores, engine, spare):
    assert auto_cores(cores) == (engine, spare)


def test_auto_is_sized_to_the_node_not_to_this_process_binding(tmp_path, monkeypatch):
    """`python -m serve_app` binds Ray (and so every replica) to the serving cores before the
    replicas resolve auto: the node's cores come from the cgroup's cpuset, not the affinity."""
    cpuset = tmp_path / "cpuset.cpus.effective"
    cpuset.write_text("0-15\n")
    monkeypatch.setattr(placement, "CGROUP_CPUSETS", (str(tmp_path / "missing"), str(cpuset)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # bound to a serving core
    assert node_cores() == set(range(16))
    assert resolve_cpus("auto") == tuple(range(2, 16))
    assert resolve_cpus(" AUTO ", spare=True) == (0, 1)
    assert resolve_cpus("3-4") == (3, 4)  # anything else as parse_cpus reads it
    monkeypatch.setattr(placement, "CGROUP_CPUSETS", (str(tmp_path / "missing"),))
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert node_cores() == set(range(6))  # no cpuset: every core of the machine
