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

from soak import replica_rss_mb, rss_growth, settle, soak  # noqa: E402

pytestmark = pytest.mark.slow

RSS_SLACK_MB = 256  # an allocator's high-water mark moves; a leak over a minute goes past it


def test_a_minute_of_mixed_traffic_leaves_the_server_idle(server):
    asyncio.run(soak(server, duration_s=10, clients=8, seed=1))  # warm-up
    settle(server)
    before = replica_rss_mb()
    result = asyncio.run(soak(server, duration_s=60, clients=8, seed=0))
    assert result["num_errors"] == 0, result["errors"]
    assert set(result["by_fate"]) == {"complete", "disconnect", "server_timeout",
                                      "client_timeout", "stop"}  # fmt: skip
    assert "embeddings" in result["by_family"] and result["requests"] > 100
    assert settle(server) == {key: 0.0 for key in
                              ("num_requests_running", "num_requests_waiting",
                               "npu_cache_usage_perc")}  # fmt: skip
    growth = rss_growth(before, replica_rss_mb())
    assert {"ModelReplica", "Ingress", "engine process"} <= set(growth), growth
    assert all(mb <= RSS_SLACK_MB for mb in growth.values()), growth
