"""The decode side of the KV hand-off: the request's timeout, the connector's own failures and
the KV loss policy, without Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.disagg.handoff import HandoffFailed, fetch_kv
from serve_app.messages import ErrorKind, KVTransfer

TRANSFER = KVTransfer(connector="fake", ref=None, num_tokens=4, nbytes=128)


class _Connector:
    name = "fake"

    def __init__(self, fetch):
        self._fetch = fetch

    async def fetch(self, transfer):
        return await self._fetch()


async def _slow():
    await asyncio.sleep(10)


async def _connector_timeout():
    raise TimeoutError("the connector's transfer timeout")


async def _payload():
    return "kv"


def fetch(connector_fetch, deadline=None, policy="recompute"):
    connector = _Connector(connector_fetch)
    return asyncio.run(fetch_kv(connector, TRANSFER, deadline, 0.05, policy, "r1"))


def test_a_fetched_kv_reports_its_bytes():
    kv, handoff = fetch(_payload)
    assert kv == "kv" and handoff.kv_bytes == 128
    assert not handoff.recomputed and not handoff.lost


def test_the_requests_timeout_running_out_fails_it_as_a_timeout():
    with pytest.raises(HandoffFailed) as caught:
        fetch(_slow, deadline=time.monotonic() + 0.05)
    assert caught.value.kind == ErrorKind.TIMEOUT and "KV hand-off" in caught.value.message


@pytest.mark.parametrize("deadline", [None, 10.0])
def test_the_connectors_own_timeout_is_a_lost_kv(deadline):
    """Not the request's timeout (none, or far away): the KV loss policy decides."""
    deadline = None if deadline is None else time.monotonic() + deadline
    kv, handoff = fetch(_connector_timeout, deadline=deadline)
    assert kv is None and handoff.recomputed and handoff.lost
    with pytest.raises(HandoffFailed) as caught:
        fetch(_connector_timeout, deadline=deadline, policy="fail")
    assert caught.value.kind == ErrorKind.ENGINE and caught.value.lost


def test_nothing_staged_means_recompute():
    kv, handoff = asyncio.run(fetch_kv(None, None, None, None, "fail", "r1"))
    assert kv is None and handoff.recomputed and not handoff.lost
