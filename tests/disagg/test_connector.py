"""KV connectors: the in-process one, and the object-store one through a real Ray object store
(a local Ray for this module, unless this process already runs one)."""

import asyncio

import pytest
import torch

from serve_app.disagg.connector import (
    HOLD_S,
    LocalConnector,
    ObjectStoreConnector,
    connector_for,
)
from serve_app.engine.kv_transfer import KVPayload
from serve_app.messages import KVTransfer


def payload(num_tokens=5):
    keys = [torch.randn(num_tokens, 2, 4) for _ in range(3)]
    values = [torch.randn(num_tokens, 2, 4) for _ in range(3)]
    return KVPayload(num_tokens, keys, values, torch.float32, read_ms=1.5)


def test_local_connector_round_trip():
    connector = connector_for("local")
    assert isinstance(connector, LocalConnector) and connector.name == "local"
    sent = payload()
    transfer = asyncio.run(connector.send(sent))
    assert transfer.connector == "local" and transfer.num_tokens == 5
    assert transfer.nbytes == sent.nbytes == 2 * 3 * 5 * 2 * 4 * 4
    assert transfer.staged_ms == 1.5  # nothing to stage beyond the engine's gather
    assert asyncio.run(connector.fetch(transfer)) is sent


def test_local_connector_refuses_a_foreign_ref():
    with pytest.raises(TypeError):
        asyncio.run(LocalConnector().fetch(KVTransfer("local", "not a payload", 1, 0)))


def test_unknown_connector_is_named():
    assert isinstance(connector_for("object_store"), ObjectStoreConnector)
    with pytest.raises(ValueError, match="hccl"):
        connector_for("hccl")


@pytest.fixture(scope="module")
def local_ray():
    """Ray in this process: the one already initialised here if any (in the whole suite, the
    serve tests' session cluster: tests/conftest.py runs this module after the first serve
    modules; it is left running), else a local instance of its own (address "local": never
    another cluster on this machine), shut down after this module."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()


def test_object_store_connector_round_trip(local_ray):
    connector = ObjectStoreConnector(timeout_s=30)
    sent = payload()

    async def run():
        transfer = await connector.send(sent)
        return transfer, await connector.fetch(transfer)

    transfer, got = asyncio.run(run())
    assert transfer.connector == "object_store" and transfer.nbytes == sent.nbytes
    assert transfer.staged_ms >= sent.read_ms
    # through the object store: the handle is an ObjectRef, and what comes back is a copy
    assert isinstance(transfer.ref, local_ray.ObjectRef)
    assert got is not sent and isinstance(got, KVPayload) and got.num_tokens == 5
    for a, b in zip(sent.keys + sent.values, got.keys + got.values, strict=True):
        assert torch.equal(a, b)


def test_the_owner_keeps_a_staged_kv_for_its_hold(local_ray):
    # the handle as plain pickle (bytes Ray's reference counting does not follow), every other
    # ref dropped: within the hold the object is still there; after it, it is freed
    import gc
    import pickle

    async def staged_then_fetched(hold_s):
        connector = ObjectStoreConnector(timeout_s=3, hold_s=hold_s)
        blob = pickle.dumps(await connector.send(payload()))
        gc.collect()
        await asyncio.sleep(0.5)  # past a short hold, well within the default one
        return await connector.fetch(pickle.loads(blob))

    assert isinstance(asyncio.run(staged_then_fetched(HOLD_S)), KVPayload)
    freed = (TimeoutError, local_ray.exceptions.RayError)  # the wait times out, or Ray says so
    with pytest.raises(freed):
        asyncio.run(staged_then_fetched(0.01))
