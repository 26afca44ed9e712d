"""A model replica's engine figures, recorded per replica through Ray Serve's metrics: gauges
as they are, the engine's running totals as counter increments, tagged by model and role."""

import pytest

from serve_app.engine.outputs import CompletionOutput, RequestOutput, StepMetrics
from serve_app.replica import replica_metrics
from serve_app.replica.replica_metrics import (
    COUNTERS,
    GAUGES,
    GENERATED,
    HISTOGRAMS,
    ReplicaMetrics,
)


class Recorded:
    def __init__(self, name, description="", *boundaries, tag_keys=()):
        self.name, self.tag_keys, self.values, self.tags = name, tag_keys, [], None

    def observe(self, value):
        self.values.append(value)

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

    def make(name, description="", *boundaries, tag_keys=()):
        made[name] = Recorded(name, description, *boundaries, tag_keys=tag_keys)
        return made[name]

    for kind in ("Gauge", "Counter", "Histogram"):
        monkeypatch.setattr(metrics, kind, make)
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
    assert set(recorded) == {name for name, _, _ in GAUGES + COUNTERS + HISTOGRAMS} | {GENERATED[0]}
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


def _output(new_tokens: int, choices: int = 1, **timing) -> RequestOutput:
    outputs = [CompletionOutput(i, [1] * new_tokens, [1] * new_tokens) for i in range(choices)]
    return RequestOutput("r", [], outputs, metrics=StepMetrics(**timing))


def test_each_requests_timing_and_tokens_per_replica(recorded):
    """Time to first token and between tokens, as the engine measured them, and the tokens
    generated, from the outputs the replica noted since the last record."""
    metrics = ReplicaMetrics("demo", "colocated", dict)
    metrics.note(_output(1, prefill_time_ms=40.0))
    metrics.note(_output(1, choices=2, decode_time_ms=25.0))  # n=2: a token for each choice
    beam = _output(3)  # reported at its end: every step's timing in its history
    beam.step_history = [StepMetrics(prefill_time_ms=80.0), StepMetrics(decode_time_ms=30.0)]
    metrics.note(beam)
    metrics.record()
    metrics.record()  # nothing noted since: nothing recorded
    metrics.close()
    ttft, itl = (recorded[name].values for name, _, _ in HISTOGRAMS)
    assert ttft == [0.04, 0.08] and itl == [0.025, 0.03]
    assert recorded[GENERATED[0]].values == [6]
