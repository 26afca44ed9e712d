"""KV connectors: how a prompt's KV gets from the prefill replica to the decode replica.

A connector has two coroutines: `send(payload)` on the prefill side stages a `KVPayload` and
returns a small picklable `KVTransfer` handle (it crosses the ingress with the first token), and
`fetch(transfer)` on the decode side turns the handle back into a payload. Both measure what
the metrics report: `KVTransfer.nbytes` and `staged_ms` (device -> host gather plus staging).

Built in:
- `ObjectStoreConnector` ("object_store"): the payload (per-layer CPU tensors) goes into the Ray
  object store with `ray.put`; the handle's ref is the ObjectRef, so decode may run on another
  node and Ray moves the bytes. The prefill replica owns the object: if it dies before decode
  fetches, the fetch fails (OwnerDiedError / ObjectLostError) and the decode replica applies its
  kv_loss_policy (recompute the prompt, or fail). Ray's reference counting should keep the
  object alive while the handle travels through the ingress, yet a KV was seen freed before
  decode fetched it (ReferenceCountingAssertionError, once, on a loaded machine); so the owner
  also keeps its ref for HOLD_S after staging, whoever else holds one.
- `LocalConnector` ("local"): the ref is the payload itself; both sides in one process (tests,
  single-process tools).

A device-direct Ascend connector (HCCL, or LLM-DataDist pulling blocks NPU to NPU over RoCE /
HCCS, as MindIE does) plugs in by implementing the same two methods: `send` would keep the
prompt's blocks pinned on the prefill NPU instead of gathering them to the host (the engine
would export block ids rather than a CPU payload) and return a transfer whose `ref` carries the
remote cluster id and the block addresses; `fetch` would allocate blocks in the decode pool and
pull them device to device, then signal the prefill side to release its blocks. Register it in
`connector_for` under its own name; the replicas and the ingress only see `KVTransfer`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from serve_app.engine.kv_transfer import KVPayload
from serve_app.messages import KVTransfer


class KVConnector(Protocol):
    name: str

    async def send(self, payload: KVPayload) -> KVTransfer: ...

    async def fetch(self, transfer: KVTransfer) -> KVPayload: ...


class LocalConnector:
    """In-process hand-off: the transfer carries the payload itself."""

    name = "local"

    async def send(self, payload: KVPayload) -> KVTransfer:
        return KVTransfer(self.name, payload, payload.num_tokens, payload.nbytes, payload.read_ms)

    async def fetch(self, transfer: KVTransfer) -> KVPayload:
        if not isinstance(transfer.ref, KVPayload):
            raise TypeError(f"a local transfer carries a KVPayload, got {type(transfer.ref)}")
        return transfer.ref


HOLD_S = 10.0  # the owner keeps a staged KV this long: MindIE's kv_trans_timeout default


class ObjectStoreConnector:
    """Through the Ray object store: works across nodes; needs a running Ray (a replica)."""

    name = "object_store"

    def __init__(self, timeout_s: float | None = None, hold_s: float = HOLD_S) -> None:
        self.timeout_s = timeout_s  # MindIE's kv_trans_timeout; None: wait as long as it takes
        self.hold_s = hold_s

    async def send(self, payload: KVPayload) -> KVTransfer:
        import ray

        start = time.monotonic()
        # ray.put serializes and copies the tensors: off the event loop, which streams others.
        ref = await asyncio.to_thread(ray.put, payload)
        asyncio.get_running_loop().call_later(self.hold_s, _let_go, ref)
        staged_ms = payload.read_ms + (time.monotonic() - start) * 1e3
        return KVTransfer(self.name, ref, payload.num_tokens, payload.nbytes, staged_ms)

    async def fetch(self, transfer: KVTransfer) -> KVPayload:
        payload = await asyncio.wait_for(_await(transfer.ref), self.timeout_s)
        if not isinstance(payload, KVPayload):
            raise TypeError(f"the KV object holds {type(payload)}, not a KVPayload")
        return payload


def _let_go(ref) -> None:
    """A hold's end: until this timer ran, its pending argument kept `ref` alive."""


async def _await(ref):
    return await ref  # an ObjectRef is awaitable inside an asyncio actor or driver


_CONNECTORS = {"local": LocalConnector, "object_store": ObjectStoreConnector}


def connector_for(name: str) -> KVConnector:
    try:
        return _CONNECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(_CONNECTORS)}") from None
