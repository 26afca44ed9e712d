"""The KV cache's memory, allocated by a thread of its own at the lowest priority.

The cache is the kernel's fresh anonymous memory (`zeros_on_huge_pages`): zero until written,
each page allocated when first written. Written in at start-up, as torch.zeros would, the whole
cache was held from the start, but a 2 GB cache on 2 MiB pages took 2.5-5 s of the engine's core
while the replica started (the kernel clears each huge page it hands out), the last step before
the engine said it was ready. Once the whole cache is mapped (`commit_later`, from the backend's
`hold_kv`), a thread asks the kernel to allocate every page (MADV_POPULATE_WRITE: as a write
would, without writing: the step loop may already be writing KV there) at Linux's lowest
priority (SCHED_IDLE: it runs when the engine's core would idle), 2 MiB at a time (the kernel
holds the process's memory map for each request, and an allocation elsewhere in the process
waits for it), so the cache is held a few seconds after the engine is ready; a step that writes
a page first allocates it itself. Where the kernel cannot (before Linux 5.14, other systems),
the cache is written in at once, as before (`can_commit`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
CHUNK = 2 << 20  # bytes allocated per request: one huge page
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


def _populate(address: int, nbytes: int) -> bool:
    """Allocates the pages of [address, address + nbytes) now, as writing them would; False
    where the kernel cannot."""
    return _MADVISE is not None and _MADVISE(address, nbytes, MADV_POPULATE_WRITE) == 0


@functools.cache
def _kernel_commits() -> bool:
    """Whether the kernel allocates pages on request (asked once, for a page of its own)."""
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        view = ctypes.c_char.from_buffer(page)
        try:
            return _populate(ctypes.addressof(view), mmap.PAGESIZE)
        finally:
            del view  # (the mapping closes only without it)


def can_commit(tensor: torch.Tensor) -> bool:
    """Whether the tensor's pages can be left to the committing thread."""
    return tensor.numel() > 0 and _kernel_commits()


def commit_later(tensors: Iterable[torch.Tensor]) -> None:
    """Has the committing thread allocate the tensors' pages (fresh anonymous memory, each at a
    page boundary, that can_commit); a tensor freed before its turn is skipped."""
    global _worker
    with _lock:
        for tensor in tensors:
            _pending.put(weakref.ref(tensor))
        if _worker is None:
            _worker = threading.Thread(target=_commit, name="kv-commit", daemon=True)
            _worker.start()


def _commit() -> None:
    with contextlib.suppress(AttributeError, OSError):  # (SCHED_IDLE: Linux)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        tensor = _pending.get()()  # held while it is committed (freed, its pages could be reused)
        if tensor is None:
            continue
        start, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
        for offset in range(0, nbytes, CHUNK):
            if not _populate(start + offset, min(CHUNK, nbytes - offset)):
                logger.debug("allocating %d bytes of KV cache failed", nbytes)
                break
        del tensor
