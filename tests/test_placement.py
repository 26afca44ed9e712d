"""Core lists and the split between an engine process's cores and the serving path's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

# A process that starts, as `python -m serve_app` starts Ray, a child that starts a child with a
# second thread, and a child that binds itself to a core (an engine process); then moves its
# descendants to the serving core and says where each thread of each is.
DRIVER = """import json, os, subprocess, sys
from serve_app.placement import bind_descendants
serving, engine = int(sys.argv[1]), int(sys.argv[2])
code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); print(1)"
tree = "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); c.wait()"
bound = f"import os, time; os.sched_setaffinity(0, {{{engine}}}); print(1, flush=True); "
bound += "time.sleep(60)"
procs = [subprocess.Popen([sys.executable, "-c", tree, code], stdout=subprocess.PIPE),
         subprocess.Popen([sys.executable, "-c", bound], stdout=subprocess.PIPE)]
for proc in procs:
    proc.stdout.readline()

def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]

def cores(pid):
    return [sorted(os.sched_getaffinity(int(t))) for t in sorted(os.listdir(f"/proc/{pid}/task"))]

moved = bind_descendants({serving})
(grandchild,) = children(procs[0].pid)
print(json.dumps({"moved": moved, "tree": cores(procs[0].pid), "grandchild": cores(grandchild),
                  "bound": cores(procs[1].pid), "itself": cores(os.getpid())}))
for pid in [grandchild] + [p.pid for p in procs]:
    os.kill(pid, 9)
"""


def test_bind_descendants_moves_what_inherited_the_cores_and_leaves_what_bound_itself():
    """What `python -m serve_app` does once the app is up: Ray's processes and theirs (here a
    child, its child and that one's thread) onto the serving cores; a process that bound itself
    (an engine process) stays where it is, and so does the process that moves them."""
    here = os.sched_getaffinity(0)
    if len(here) < 2:
        pytest.skip("needs two cores")
    serving, engine = min(here), max(here)
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, str(serving), str(engine)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    where = json.loads(run.stdout)
    assert where["moved"] == 2 and where["tree"] == [[serving]]
    assert where["grandchild"] == [[serving]] * 2  # (it printed once its thread had started)
    assert where["bound"] == [[engine]] and where["itself"] == [sorted(here)]


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
