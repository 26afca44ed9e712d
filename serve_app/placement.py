"""Core placement: CPU core lists ("0-3,6") and binding a whole process to a set of cores.

An engine process bound to its own cores (ModelConfig `engineCpus`) steps without the serving
path's threads taking turns on them; the ingress and the tokenizer pool then bind to the cores
left over (`serving_cores`). (The engine may also borrow what the serving path leaves idle of
those, `engineSpareCpus`: the CPU backend's `spare_cores`.) Linux only; elsewhere binding is a
no-op.

`auto` (the value deployments.yaml ships) sizes both to the node: on `n` cores the serving path
keeps the lowest `max(1, n // 8)` and the engine is bound to the rest, borrowing the serving
cores' idle time; on one core nothing is bound. So a 2-core machine gets the engine on core 1
with core 0 lent to it, and a 16-core node the engine on cores 2-15.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

AUTO = "auto"
CGROUP_CPUSETS = (  # cgroup v2, then v1
    "/sys/fs/cgroup/cpuset.cpus.effective",
    "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
)


def node_cores() -> set[int]:
    """The cores this machine or container lets its processes use, whatever this process is
    bound to now (Ray's workers inherit the binding `python -m serve_app` gives Ray): the
    cgroup's cpuset, else every core."""
    for path in CGROUP_CPUSETS:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return set(parse_cpus(text))
    return set(range(os.cpu_count() or 1))


def auto_cores(cores: Iterable[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(engine cores, spare cores) for `auto` on `cores` (default: the node's): the serving
    path keeps the lowest max(1, n // 8) of n cores, lent to the engine as spare cores, and the
    engine is bound to the rest; ((), ()) on a single core."""
    ordered = sorted(node_cores() if cores is None else cores)
    if len(ordered) < 2:
        return (), ()
    keep = kept_for_serving(len(ordered))
    return tuple(ordered[keep:]), tuple(ordered[:keep])


def kept_for_serving(n: int) -> int:
    """Of a node's n cores, how many `auto` keeps for the serving path (the rest: the engine)."""
    return max(1, n // 8)


def resolve_cpus(text: str, spare: bool = False) -> tuple[int, ...]:
    """A core list as `parse_cpus` reads it, or `auto` sized to this node (`auto_cores`: the
    engine's cores, or with `spare` its spare cores)."""
    if text.strip().lower() == AUTO:
        return auto_cores()[1 if spare else 0]
    return parse_cpus(text)


def parse_cpus(text: str) -> tuple[int, ...]:
    """'1' / '0-3' / '0,2,4-5' -> sorted core ids; '' -> (). ValueError names the bad part."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"{part!r} is not a core id or range: write e.g. '1', '0-3' or '0,2,4-5'"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{part!r} is not a range of core ids (0 <= first <= last)")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def format_cpus(cores: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def available_cores() -> set[int]:
    """The cores this process runs on now."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def bind_process(cores: Iterable[int] | None) -> None:
    """Every thread of this process (and the threads it starts later) on `cores` only; None or
    no cores: left as it is.

    ValueError when a core does not exist or may not be used here, naming those that may."""
    cores = set(cores or ())
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    missing = {c for c in cores if c >= (os.cpu_count() or 1)}
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads if not missing else ():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that just ended
            pass
        except OSError:  # outside the cores this container or cgroup allows
            missing = cores
            break
    if missing:
        raise _not_available(missing)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended but not yet reaped, does not)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def descendants() -> list[int]:
    """The process ids of every process below this one, children first. Linux only (elsewhere
    none)."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(entry)
        if fields and len(fields) > 1:  # (else gone meanwhile)
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(os.getpid(), ()))
    while todo:
        found.append(todo.pop(0))
        todo += children.get(found[-1], ())
    return found


def bind_descendants(cores: Iterable[int]) -> int:
    """Every thread of this process's descendants that is still on the cores this one is on
    (inherited: not bound since by themselves, as engine processes and replicas bind) onto
    `cores`; the number of processes moved. Linux only (elsewhere 0)."""
    cores = set(cores)
    if not cores or not hasattr(os, "sched_setaffinity"):
        return 0
    unbound = os.sched_getaffinity(0)
    moved = 0
    for pid in descendants():
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        hit = False
        for tid in threads:
            try:
                if os.sched_getaffinity(tid) == unbound:
                    os.sched_setaffinity(tid, cores)
                    hit = True
            except OSError:  # the thread ended, or is not ours to move
                pass
        moved += hit
    return moved


def check_cores(cores: Iterable[int]) -> None:
    """ValueError when one of `cores` is not among those this process may use, naming those."""
    missing = set(cores) - available_cores()
    if missing:
        raise _not_available(missing)


def _not_available(missing: Iterable[int]) -> ValueError:
    return ValueError(
        f"cores {format_cpus(missing)} are not available here (this process may use "
        f"{format_cpus(available_cores())})"
    )


def serving_cores(engine_cores: Iterable[int]) -> set[int] | None:
    """The cores the serving path (ingress, tokenizer pool) should keep to when engines are
    bound to `engine_cores` on this node: the rest, or None when there is nothing to leave
    (no engine binding, or it covers every core)."""
    engine = set(engine_cores)
    rest = available_cores() - engine
    return rest if engine and rest else None
