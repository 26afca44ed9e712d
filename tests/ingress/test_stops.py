"""stopInfer across ingress replicas (ingress/stops.py): two apps over the same replica, as two
ingress replicas are, sharing one StopRegistry; a stop sent to either reaches the request."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from serve_app.config import load_config
from serve_app.ingress.app import create_app
from serve_app.ingress.backend import LocalBackend
from serve_app.ingress.stops import StopRegistry
from serve_app.replica.model_replica import ModelReplica
from serve_app.tokenizer.pool import TokenizerPool
from tests.ingress.conftest import ROUTE_TEST_CONFIG

ARGS = copy.deepcopy(ROUTE_TEST_CONFIG)
ARGS.pop("EmbeddingConfig")
ARGS["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 8192
ARGS["BackendConfig"]["ScheduleConfig"].update(maxIterTimes=4096, kvCacheBlocks=1024)
LONG = 4000


@pytest.fixture(scope="module")
def parts():
    config = load_config(ARGS)
    replica = ModelReplica(config)
    yield config, TokenizerPool(config), replica
    replica.shutdown()


def _apps(parts, registry):
    config, pool, replica = parts
    return [
        create_app(config, LocalBackend(pool, {"demo": replica}, stop_registry=registry))
        for _ in range(2)
    ]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _stop_from(client: httpx.AsyncClient, request_id: str, running: asyncio.Task):
    """stopInfer until it finds the request (it needs a moment to start), or it has ended."""
    while not running.done():
        stop = await client.post("/v2/models/demo/stopInfer", json={"id": request_id})
        if stop.status_code == 200:
            return stop
        await asyncio.sleep(0.01)
    return stop


def test_a_stop_sent_to_the_other_ingress_replica_stops_the_request(parts):
    app_a, app_b = _apps(parts, StopRegistry())
    body = {"id": "shared-1", "text_input": "count",
            "parameters": {"max_new_tokens": LONG, "details": True}}  # fmt: skip

    async def scenario():
        async with _client(app_a) as a, _client(app_b) as b:
            running = asyncio.create_task(a.post("/v2/models/demo/generate", json=body))
            stop = await _stop_from(b, "shared-1", running)
            return stop, await running

    stop, done = asyncio.run(scenario())
    assert stop.status_code == 200 and stop.json() == {"id": "shared-1"}
    details = done.json()["details"]
    assert details["finish_reason"] == "stop_sequence" and details["generated_tokens"] < LONG


def test_without_a_shared_registry_the_other_replica_does_not_know_the_id(parts):
    app_a, app_b = _apps(parts, None)
    body = {"id": "alone-1", "text_input": "count", "parameters": {"max_new_tokens": 200}}

    async def scenario():
        async with _client(app_a) as a, _client(app_b) as b:
            running = asyncio.create_task(a.post("/v2/models/demo/generate", json=body))
            while "alone-1" not in app_a.state.pipeline.stops._events:  # A has registered it
                await asyncio.sleep(0.001)
            missed = await b.post("/v2/models/demo/stopInfer", json={"id": "alone-1"})
            found = await a.post("/v2/models/demo/stopInfer", json={"id": "alone-1"})
            await running
            return missed, found

    missed, found = asyncio.run(scenario())
    assert missed.status_code == 404 and found.status_code == 200


def test_the_registry_forgets_an_id_whose_request_ended():
    async def scenario():
        registry = StopRegistry()
        held = asyncio.create_task(registry.hold("x"))
        await asyncio.sleep(0)
        assert registry.stop("x") and await held  # a stop releases the hold with True
        ended = asyncio.create_task(registry.hold("y"))
        await asyncio.sleep(0)
        ended.cancel()  # the request ended first
        await asyncio.gather(ended, return_exceptions=True)
        return registry.stop("y")

    assert asyncio.run(scenario()) is False


def test_a_hold_that_fails_ends_its_watch_quietly():
    """Ray Serve cancels the registry hold with its request when the client leaves: the watch
    ends there, with no 'Task exception was never retrieved' left for the event loop."""

    class Cancelled(Exception):
        pass

    class Failing(LocalBackend):
        def _hold(self, key):
            async def hold():
                raise Cancelled(key)

            return hold(), lambda: None

    async def scenario():
        unhandled = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        backend = Failing(None, {}, stop_registry=object())
        event = asyncio.Event()
        backend.watch_stop("gone", event)
        for _ in range(3):
            await asyncio.sleep(0)
        import gc

        gc.collect()
        return unhandled, event.is_set()

    unhandled, stopped = asyncio.run(scenario())
    assert unhandled == [] and not stopped
