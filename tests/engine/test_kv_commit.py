"""The CPU KV cache's memory: zeros from the start, its pages allocated by a thread of its own
at the lowest priority rather than written in while the engine starts (backends/cpu/commit.py)."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
import weakref

import pytest
import torch

from serve_app.engine.backends.cpu import commit
from serve_app.engine.backends.cpu import kernels as cpu_kernels

MIB = 1 << 20


def _fresh(nbytes: int) -> torch.Tensor:
    zeros = cpu_kernels.op("zeros_on_huge_pages")
    if zeros is None:
        pytest.skip("the kernels did not build on this machine")
    return zeros([nbytes], torch.uint8)


def _resident(tensor: torch.Tensor) -> int:
    """How many of the tensor's pages are allocated now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-tensor.nbytes // mmap.PAGESIZE)
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(tensor.data_ptr(), tensor.nbytes, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector.raw)


def _committed(tensor: torch.Tensor, timeout_s: float = 30) -> bool:
    pages = -(-tensor.nbytes // mmap.PAGESIZE)
    deadline = time.monotonic() + timeout_s
    while _resident(tensor) < pages:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _backend():
    from serve_app.engine.backends.cpu import CPUBackend
    from serve_app.engine.config import EngineConfig

    config = EngineConfig(model="demo-tiny", dtype="float32", num_kv_blocks=64)
    return CPUBackend(config, torch.device("cpu"), torch.float32)


def test_the_cache_is_zeros_and_held_soon_without_being_written():
    if not commit._kernel_commits():
        pytest.skip("this kernel does not allocate pages on request (Linux 5.14+)")
    backend = _backend()
    if cpu_kernels.op("zeros_on_huge_pages") is None:
        pytest.skip("the kernels did not build on this machine")
    caches = [(backend.kv_zeros((1024, 8, 16, 64)), backend.kv_zeros((1024, 8, 16, 64)))]
    k, v = caches[0]
    assert _resident(k) == _resident(v) == 0  # the kernel's fresh memory: nothing allocated yet
    k[3, 1, 2, 5] = 7.0  # the engine may write KV before the thread gets there
    backend.hold_kv(caches)
    assert _committed(k) and _committed(v), "the KV cache's pages were never allocated"
    assert k[3, 1, 2, 5] == 7.0 and int(k.count_nonzero()) == 1 and not v.any()


def test_where_the_kernel_cannot_allocate_on_request_the_cache_is_written_in_at_once(
    monkeypatch,
):
    monkeypatch.setattr(commit, "_kernel_commits", lambda: False)
    backend = _backend()
    if cpu_kernels.op("zeros_on_huge_pages") is None:
        pytest.skip("the kernels did not build on this machine")
    cache = backend.kv_zeros((256, 8, 16, 64))
    assert _resident(cache) == -(-cache.nbytes // mmap.PAGESIZE) and not cache.any()


def test_a_cache_waiting_for_its_turn_is_not_held_alive(monkeypatch):
    """The committing thread holds no cache alive but the one it commits: one freed before its
    turn (an engine stopped at once) is unmapped then, not committed later."""
    gate = threading.Event()

    def populate(address, nbytes):  # every request waits at the gate
        gate.wait(30)
        return True

    monkeypatch.setattr(commit, "_populate", populate)
    try:
        first, second = _fresh(MIB), _fresh(MIB)
        commit.commit_later([first])  # the thread takes it and waits at the gate
        commit.commit_later([second])
        freed = weakref.ref(second)
        del second
        assert freed() is None
    finally:
        gate.set()
