"""A model replica's engine figures, recorded per replica through Ray Serve's metrics: gauges
as they are, the engine's running totals as counter increments, tagged by model and role."""

import pytest

from serve_app.replica import replica_metrics
from serve_app.replica.replica_metrics import COUNTERS, GAUGES, ReplicaMetrics


class Recorded:
    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.values, self.tags = name, tag_keys, [], None

    def set_default_tags(self, tags):
        self.tags = tags

    def set(self, value):
        self.values.append(value)

    def inc(self, value):
        self.values.append(value)


@pytest.fixture
def recorded(monkeypatch):
    from ray.serve import metrics

    made = {}

    def make(name, description="", tag_keys=()):
        made[name] = Recorded(name, description, tag_keys)
        return made[name]

    monkeypatch.setattr(metrics, "Gauge", make)
    monkeypatch.setattr(metrics, "Counter", make)
    monkeypatch.setattr(replica_metrics, "PERIOD_S", 3600)  # recorded by hand below
    return made


def test_gauges_and_counter_increments_per_replica(recorded):
    stats = {"num_running": 3, "num_waiting": 1, "kv_usage": 0.5, "prefix_cache_hits": 10,
             "prefix_cache_queries": 16, "num_preemptions": 0, "num_steps": 40}  # fmt: skip
    metrics = ReplicaMetrics("demo", "prefill", lambda: stats)
    metrics.record()
    stats.update(num_running=0, prefix_cache_hits=14, prefix_cache_queries=20, num_steps=41)
    metrics.record()
    metrics.close()
    assert set(recorded) == {name for name, _, _ in GAUGES + COUNTERS}
    assert all(m.tags == {"model": "demo", "role": "prefill"} for m in recorded.values())
    assert recorded["serve_app_requests_running"].values == [3, 0]
    assert recorded["serve_app_kv_cache_usage"].values == [0.5, 0.5]
    assert recorded["serve_app_prefix_cache_hits"].values == [10, 4]  # increments
    assert recorded["serve_app_preemptions"].values == []  # nothing to add


def test_ray_serves_own_metrics_take_the_tags_inside_a_replica(monkeypatch):
    """With the replica context Ray Serve sets in a replica (which adds its application,
    deployment and replica tags to each metric's): every metric is made and records."""
    from types import SimpleNamespace

    from ray.serve import context

    replica = SimpleNamespace(deployment="ModelReplica", replica_tag="abc", app_name="serve_app")
    monkeypatch.setattr(context, "_get_internal_replica_context", lambda: replica)
    monkeypatch.setattr(replica_metrics, "PERIOD_S", 3600)
    metrics = ReplicaMetrics("demo", "colocated", lambda: {"num_running": 1, "num_steps": 2})
    metrics.record()
    metrics.close()
    assert all(g._default_tags["replica"] == "abc" for g, _ in metrics._gauges)
