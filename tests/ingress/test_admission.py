"""Admission (ingress/admission.py): maxLinkNum requests run, twice as many wait, the rest are
refused at once in the family's envelope with Retry-After; nothing leaks a slot."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from serve_app.ingress.admission import Admission
from tests.ingress.conftest import ROUTE_TEST_CONFIG, local_app


class Gate:
    """An inner ASGI app whose POSTs wait until released; counts what got through."""

    def __init__(self) -> None:
        self.entered = 0
        self.release = asyncio.Event()

    async def __call__(self, scope, receive, send):
        if scope["method"] == "POST":
            self.entered += 1
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0)


def test_over_the_limit_and_queue_is_refused_at_once_then_the_queue_drains():
    async def scenario():
        gate = Gate()
        admission = Admission(gate, limit=2, queue=1)
        async with _client(admission) as client:
            held = [asyncio.create_task(client.post("/infer", json={})) for _ in range(3)]
            await _until(lambda: gate.entered == 2 and len(admission.waiting) == 1)
            refused = await client.post("/infer", json={})  # answered while the others wait
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            body = refused.json()
            assert body["error_type"] == "Service Unavailable"
            assert "maxLinkNum" in body["error"] and "2 requests running" in body["error"]
            # reads, health and stopInfer are never held back
            assert (await client.get("/health")).status_code == 200
            stop = asyncio.create_task(client.post("/v2/models/m/stopInfer", json={}))
            await _until(lambda: gate.entered == 3)
            gate.release.set()
            assert [r.status_code for r in await asyncio.gather(stop, *held)] == [200] * 4
        assert gate.entered == 4 and admission.running == 0 and not admission.waiting
        assert admission.refused == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("path", "status", "check"),
    [
        ("/v1/chat/completions", 503, lambda b: b["error"]["type"] == "ServiceUnavailableError"),
        ("/v2/models/m/generate", 503, lambda b: "maxLinkNum" in b["error"]),
        (
            "/serving-endpoints/m/invocations",
            429,
            lambda b: b["error_code"] == "REQUEST_LIMIT_EXCEEDED",
        ),
    ],
)
def test_refusals_use_the_family_envelope(path, status, check):
    async def scenario():
        gate = Gate()
        admission = Admission(gate, limit=1, queue=0)
        async with _client(admission) as client:
            held = asyncio.create_task(client.post(path, json={}))
            await _until(lambda: gate.entered == 1)
            refused = await client.post(path, json={})
            gate.release.set()
            assert (await held).status_code == 200
        assert refused.status_code == status and refused.headers["retry-after"] == "1"
        assert check(refused.json())

    asyncio.run(scenario())


def test_a_waiting_client_that_goes_away_leaves_the_queue():
    async def scenario():
        gate = Gate()
        admission = Admission(gate, limit=1, queue=1)
        async with _client(admission) as client:
            held = asyncio.create_task(client.post("/infer", json={}))
            await _until(lambda: gate.entered == 1)
            waiter = asyncio.create_task(client.post("/infer", json={}))
            await _until(lambda: len(admission.waiting) == 1)
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert not admission.waiting
            queued = asyncio.create_task(client.post("/infer", json={}))  # its place is free
            await _until(lambda: len(admission.waiting) == 1)
            gate.release.set()
            assert [(await t).status_code for t in (held, queued)] == [200, 200]
        assert admission.running == 0 and gate.entered == 2

    asyncio.run(scenario())


def test_the_served_app_admits_max_link_num_and_its_queue():
    """The real app with maxLinkNum 1: one request runs, two wait, the fourth is refused; the
    tokenizer pool is held shut so that the first three stay in flight."""
    args = copy.deepcopy(ROUTE_TEST_CONFIG)
    args["ServerConfig"] = {**args["ServerConfig"], "maxLinkNum": 1}
    app, replica = local_app(args)
    pipeline = app.state.pipeline
    opened = asyncio.Event()
    started = []
    tokenize = pipeline.tokenize

    async def held_tokenize(req):
        started.append(req)
        await opened.wait()
        return await tokenize(req)

    pipeline.tokenize = held_tokenize
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}

    async def scenario():
        async with _client(app) as client:
            first = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            await _until(lambda: len(started) == 1)
            for _ in range(50):  # let the other two reach the queue
                await asyncio.sleep(0)
            refused = await client.post("/serving-endpoints/demo/invocations", json=body)
            assert len(started) == 1  # the queued two have not started
            opened.set()
            served = await asyncio.gather(*first)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error_code"] == "REQUEST_LIMIT_EXCEEDED"
        assert [r.status_code for r in served] == [200] * 3
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in served)

    try:
        asyncio.run(scenario())
    finally:
        replica.shutdown()


def test_a_request_that_can_never_fit_the_kv_pool_is_refused_at_once():
    """A KV pool of 8 blocks x 16 tokens under maxSeqLen 512: a prompt plus its output that
    needs more than the whole pool is refused before it is queued, naming both numbers."""
    from fastapi.testclient import TestClient

    args = copy.deepcopy(ROUTE_TEST_CONFIG)
    args["BackendConfig"]["ScheduleConfig"]["kvCacheBlocks"] = 8
    app, replica = local_app(args)
    prompt = list(range(100, 200))  # 100 tokens + up to 64 output > 128 tokens of pool
    try:
        with TestClient(app) as client:
            openai = client.post(
                "/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 64}
            )
            mindie = client.post(
                "/infer_token", json={"input_id": prompt, "parameters": {"max_new_tokens": 64}}
            )
            fits = client.post(
                "/v1/completions", json={"model": "demo", "prompt": prompt[:20], "max_tokens": 8}
            )
    finally:
        replica.shutdown()
    assert openai.status_code == 400 and mindie.status_code == 424
    for message in (openai.json()["error"]["message"], mindie.json()["error"]):
        assert "KV blocks" in message and "the pool has 8" in message, message
    assert mindie.json()["error_type"] == "Generation Error"
    assert fits.status_code == 200
