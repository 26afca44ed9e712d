"""A 60-second soak over Ray (bench/soak.py's traffic): every family, streams and not, with
client disconnects, server and client timeouts and stopInfer calls; afterwards nothing runs or
waits, the KV cache is empty and the replicas' resident memory has not grown. Slow."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from soak import IDLE_KEYS, replica_rss_mb, rss_growth, settle, soak  # noqa: E402

pytestmark = pytest.mark.slow

RSS_SLACK_MB = 256  # an allocator's high-water mark moves; a leak over a minute goes past it


def _replica_stats() -> dict | str:
    """The model replica's own engine counters, asked directly (not through the ingress's
    /metrics): tells an engine that still holds a request from a stale gauge."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle("ModelReplica", app_name="serve_app")
        return handle.stats.remote().result(timeout_s=10)
    except Exception as exc:  # a diagnostic only
        return f"{type(exc).__name__}: {exc}"


def test_a_minute_of_mixed_traffic_leaves_the_server_idle(server):
    asyncio.run(soak(server, duration_s=10, clients=8, seed=1))  # warm-up
    settle(server)
    before = replica_rss_mb()
    result = asyncio.run(soak(server, duration_s=60, clients=8, seed=0))
    assert result["num_errors"] == 0, result["errors"]
    assert set(result["by_fate"]) == {"complete", "disconnect", "server_timeout",
                                      "client_timeout", "stop"}  # fmt: skip
    assert "embeddings" in result["by_family"] and result["requests"] > 100
    idle = settle(server)
    assert idle == dict.fromkeys(IDLE_KEYS, 0.0), (idle, _replica_stats())
    growth = rss_growth(before, replica_rss_mb())
    assert {"ModelReplica", "Ingress", "engine process"} <= set(growth), growth
    assert all(mb <= RSS_SLACK_MB for mb in growth.values()), growth
