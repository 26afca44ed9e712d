"""CPU core lists ("0-3,6"), binding a whole process to a set of cores, lending it spare ones.

An engine process bound to its own cores (ModelConfig `engineCpus`) steps without the serving
path's threads taking turns on them; the ingress and the tokenizer pool then bind to the cores
left over (`serving_cores`). The engine may borrow what the serving path leaves idle of those
(`engineSpareCpus`, `lend_spare_cores`). Linux only; elsewhere binding is a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)
# The helpers' chunk counters (op spare_cores_stats) while this process lends its kernels
# helpers (lend_spare_cores); None: it lends none, and reports no chunk counts.
_chunk_counts = None
CHUNK_KEYS = ("cpu_chunks_step_loop", "cpu_chunks_helpers", "cpu_chunks_taken_back")


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


def lend_spare_cores(cores: Iterable[int]) -> int:
    """Helper threads for this process's CPU GEMMs, decode attention and greedy argmax, one per
    core of `cores`, each bound to its core at the lowest priority (Linux SCHED_IDLE): they run
    only while nothing else wants the core, and a step never waits for one
    (engine/csrc/spare_cores.h). How many run: 0 for no cores, where the engine's CPU kernels
    are not built here (cpu_kernels logs why), or where the system refuses a helper its core or
    its priority (logged; the engine runs without).
    Check the cores with `check_cores` before binding the process elsewhere."""
    global _chunk_counts
    cores = sorted(set(cores))
    if not cores:
        return 0
    from serve_app.engine import cpu_kernels

    use = cpu_kernels.op("use_spare_cpus")
    if use is None:
        return 0
    try:
        helpers = int(use(cores))
    except RuntimeError as exc:
        helpers = 0  # a refused helper stops the others (spare_cores.cpp)
        log.warning("spare cores %s not lent, the engine runs without helpers: %s",
                    format_cpus(cores), str(exc).splitlines()[0])  # fmt: skip
    _chunk_counts = cpu_kernels.op("spare_cores_stats") if helpers else None
    return helpers


def shared_chunks() -> dict[str, int]:
    """Where the kernels shared with the helpers ran, chunks since the process started: on the
    step loop's own cores (`cpu_chunks_step_loop`), on the helpers' (`cpu_chunks_helpers`), and
    claimed by a helper but finished by the step loop because the helper was still at it when
    the rest was done (`cpu_chunks_taken_back`: it was preempted, or just slower; the parts of a
    decode GEMM's chunk it had put in place are kept). {} where this process lent no
    helpers."""
    if _chunk_counts is None:
        return {}
    return dict(zip(CHUNK_KEYS, (int(c) for c in _chunk_counts()[:3]), strict=True))


def serving_cores(engine_cores: Iterable[int]) -> set[int] | None:
    """The cores the serving path (ingress, tokenizer pool) should keep to when engines are
    bound to `engine_cores` on this node: the rest, or None when there is nothing to leave
    (no engine binding, or it covers every core)."""
    engine = set(engine_cores)
    rest = available_cores() - engine
    return rest if engine and rest else None
