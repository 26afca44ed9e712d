"""bench/prefix_routing.py's parts, without Ray: the app each run deploys (the same model and
limits, only the router differs) and the multi-turn workload with the hit rate it reads, against
the app served in process."""

from __future__ import annotations

import asyncio

from serve_app.config import load_config
from serve_app.deployment_options import PREFIX_ROUTER, model_replica_options
from tests.ingress.conftest import local_app, served

# small enough to run in seconds: 3 chats of 3 turns, over the shortest model
ARGV = ["--model", "demo-tiny", "--conversations", "3", "--turns", "3", "--system", "128",
        "--question", "8", "--answer", "4", "--kv-blocks", "256"]  # fmt: skip


def test_each_run_deploys_the_same_app_but_for_its_router(load_bench):
    pr = load_bench("prefix_routing")
    args = pr.parse_args(ARGV)
    routers = {}
    for router in pr.ROUTERS:
        spec = pr.app_args(4, router, args)
        options = model_replica_options(load_config(spec), 0, {"CPU": 2})
        assert options["num_replicas"] == 4
        routers[router] = options["request_router_config"]["request_router_class"]
        spec["Deployments"]["ModelReplica"].pop("request_router_config", None)
        assert spec == pr.app_args(4, "prefix", args)
    assert routers == {"prefix": PREFIX_ROUTER, "default": pr.ROUTERS["default"]}


def test_the_conversations_grow_their_history_and_the_hit_rate_counts_it(load_bench):
    """Every turn is answered, each chat's later turns (its whole history again) find their
    prefix cached, and /metrics' counters the bench reads say so."""
    pr = load_bench("prefix_routing")
    args = pr.parse_args(ARGV)
    app, replica = local_app(pr.app_args(1, "prefix", args))
    try:
        with served(app) as url:
            before = pr.counters(url)
            turns = asyncio.run(pr.conversations(url, args, seed=1))
            after = pr.counters(url)
    finally:
        replica.shutdown()
    assert sorted(t for t, _ in turns) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(ttft > 0 for _, ttft in turns)
    hits = after["prefix_cache_hits_total"] - before.get("prefix_cache_hits_total", 0)
    queries = after["prefix_cache_queries_total"] - before.get("prefix_cache_queries_total", 0)
    # the shared system prompt's block on all but the first chat, the history on later turns
    assert 0 < hits < queries, (hits, queries, before, after)
