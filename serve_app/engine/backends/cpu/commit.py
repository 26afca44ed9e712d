"""The KV cache's memory, committed by a thread of its own at the lowest priority.

The cache is the kernel's fresh anonymous memory (`zeros_on_huge_pages`): zero until written,
each page allocated when first written. Written in at start-up, as torch.zeros would, the whole
cache was held from the start, but a 2 GB cache on 2 MiB pages took 2.5-5 s of the engine's core
while the replica started (the kernel compacts memory for each huge page it hands out), the last
step before the engine said it was ready. Here a thread asks the kernel to allocate every page
(MADV_POPULATE_WRITE: as a write would, without writing: the step loop may already be writing
KV there) at Linux's lowest priority (SCHED_IDLE: it runs when the engine's core would idle), so
the cache is held a few seconds after the engine is ready, and a step that writes a page first
allocates it itself. Where the kernel cannot (before Linux 5.14, other systems), the cache is
written in at once, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_pending: queue.SimpleQueue[weakref.ref[torch.Tensor]] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_lock = threading.Lock()


def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


_MADVISE = _madvise() if os.name == "posix" else None


def _populate(tensor: torch.Tensor, nbytes: int | None = None) -> bool:
    """Allocates the tensor's pages (its first `nbytes`) now, as writing them would; False
    where the kernel cannot."""
    nbytes = tensor.untyped_storage().nbytes() if nbytes is None else nbytes
    if _MADVISE is None or nbytes == 0:
        return False
    return _MADVISE(tensor.data_ptr(), nbytes, MADV_POPULATE_WRITE) == 0


def commit_later(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor (fresh anonymous memory at a page boundary), its pages allocated by the
    committing thread; written in now where the kernel cannot allocate them so (asked for the
    first page here)."""
    global _worker
    if not _populate(tensor, 1):
        return tensor.zero_()
    with _lock:
        _pending.put(weakref.ref(tensor))  # (a cache freed before its turn is skipped)
        if _worker is None:
            _worker = threading.Thread(target=_commit, name="kv-commit", daemon=True)
            _worker.start()
    return tensor


def _commit() -> None:
    with contextlib.suppress(AttributeError, OSError):  # (SCHED_IDLE: Linux)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        tensor = _pending.get()()  # held while it is committed (freed, its pages could be reused)
        if tensor is not None and not _populate(tensor):
            logger.debug("committing %d bytes of KV cache failed", tensor.nbytes)
        del tensor
