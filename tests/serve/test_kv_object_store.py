"""The object-store KV connector on the session's Ray cluster: staged on one NPU node, fetched
on another; and a prefill replica that dies before decode fetches its KV (recompute or fail)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.disagg.connector import ObjectStoreConnector
from serve_app.engine.kv_transfer import KVPayload
from serve_app.engine.params import SamplingParams
from serve_app.messages import DecodeRequest, ReplicaRequest


def _payload(num_tokens: int = 6) -> KVPayload:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(num_tokens, 2, 8, generator=gen) for _ in range(2)]
    values = [torch.randn(num_tokens, 2, 8, generator=gen) for _ in range(2)]
    return KVPayload(num_tokens, keys, values, torch.float32)


def test_kv_staged_on_an_npu_node_is_fetched_elsewhere(cluster):
    import ray

    # (the actors take the payload as an argument: Ray workers cannot import this test module)
    @ray.remote(resources={"NPU": 1})
    class Prefill:
        def stage(self, payload):
            transfer = asyncio.run(ObjectStoreConnector().send(payload))
            return transfer, ray.get_runtime_context().get_node_id()

    prefill = Prefill.remote()
    transfer, node = ray.get(prefill.stage.remote(_payload()))
    assert node in cluster.npu_node_ids and transfer.nbytes == _payload().nbytes
    got = asyncio.run(ObjectStoreConnector(timeout_s=30).fetch(transfer))
    expected = _payload()
    for a, b in zip(expected.keys + expected.values, got.keys + got.values, strict=True):
        assert torch.equal(a, b)
    ray.kill(prefill)


@pytest.fixture(scope="module")
def lost_transfer(cluster):
    """A transfer whose owner (the "prefill replica") died before anyone fetched it."""
    import ray

    @ray.remote(num_cpus=0)
    class Prefill:
        def stage(self, payload):
            return asyncio.run(ObjectStoreConnector().send(payload))

    prefill = Prefill.remote()
    transfer = ray.get(prefill.stage.remote(_payload(5)))
    ray.kill(prefill, no_restart=True)
    return transfer


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_lost_kv_is_recomputed_or_fails_as_configured(lost_transfer, policy):
    from serve_helpers import PD_ARGS

    from serve_app.config import load_config
    from serve_app.replica.model_replica import ModelReplica

    replica = ModelReplica(load_config(PD_ARGS), role="decode", kv_loss_policy=policy)
    try:
        request = ReplicaRequest(
            "lost-1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0)
        )
        decode = DecodeRequest(
            request, first_token_id=9, transfer=lost_transfer, max_output_tokens=4
        )

        async def run():
            return [chunk async for chunk in replica.decode(decode)]

        chunks = asyncio.run(run())
        stats = asyncio.run(replica.stats())
        assert stats["num_kv_lost"] == 1
        assert stats["num_free_blocks"] == stats["num_blocks"]
        if policy == "recompute":
            assert chunks[0].kv_recomputed and chunks[-1].finished and chunks[-1].error is None
            assert chunks[-1].choices[0].num_output_tokens == 4
        else:
            assert chunks[-1].error is not None and chunks[-1].error_kind == "engine"
    finally:
        replica.shutdown()
