"""Lending the engine's CPU kernels the idle time of spare cores (ModelConfig `engineSpareCpus`).

A helper thread per lent core, bound to it at the lowest priority, takes chunks of the GEMMs,
decode attention and argmax the step loop shares out (csrc/spare_cores.h); the counters say where
the chunks ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.placement import format_cpus

log = logging.getLogger(__name__)
# The helpers' chunk counters (op spare_cores_stats) while this process lends its kernels
# helpers (lend_spare_cores); None: it lends none, and reports no chunk counts.
_chunk_counts = None
CHUNK_KEYS = ("cpu_chunks_step_loop", "cpu_chunks_helpers", "cpu_chunks_taken_back")


def lend_spare_cores(cores: Iterable[int]) -> int:
    """Helper threads for this process's CPU GEMMs, decode attention and greedy argmax, one per
    core of `cores`, each bound to its core at the lowest priority (Linux SCHED_IDLE): they run
    only while nothing else wants the core, and a step never waits for one
    (csrc/spare_cores.h). How many run: 0 for no cores, where the engine's CPU kernels
    are not built here (cpu_kernels logs why), or where the system refuses a helper its core or
    its priority (logged; the engine runs without).
    Check the cores with `placement.check_cores` before binding the process elsewhere."""
    global _chunk_counts
    cores = sorted(set(cores))
    if not cores:
        return 0
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
