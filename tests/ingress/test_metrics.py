"""The engine facts /metrics renders from each model replica's stats (ingress/metrics.py)."""

from __future__ import annotations

from serve_app.ingress.metrics import Metrics


def _lines(metrics: Metrics, name: str) -> list[str]:
    text = metrics.render().decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_the_helpers_share_of_the_cpu_kernels_is_summed_over_replicas():
    metrics = Metrics()
    chunks = {"cpu_chunks_step_loop": 60, "cpu_chunks_helpers": 40, "cpu_chunks_taken_back": 3}
    metrics.update_stats("demo", {"replica_id": "a", "num_running": 2, **chunks})
    metrics.update_stats("demo", {"replica_id": "b", "num_running": 1, **chunks})
    assert _lines(metrics, "cpu_chunks_step_loop_total") == [
        'cpu_chunks_step_loop_total{model_name="demo"} 120.0'
    ]
    assert _lines(metrics, "cpu_chunks_helpers_total") == [
        'cpu_chunks_helpers_total{model_name="demo"} 80.0'
    ]
    assert _lines(metrics, "cpu_chunks_taken_back_total") == [
        'cpu_chunks_taken_back_total{model_name="demo"} 6.0'
    ]
    assert _lines(metrics, "num_requests_running") == [
        'num_requests_running{model_name="demo"} 3.0'
    ]


def test_replicas_without_helpers_report_no_chunks():
    metrics = Metrics()
    metrics.update_stats("demo", {"replica_id": "a", "num_running": 0})
    assert _lines(metrics, "cpu_chunks_helpers_total") == [
        'cpu_chunks_helpers_total{model_name="demo"} 0.0'
    ]


def test_a_replica_that_left_stops_counting_and_its_counters_stay_in_the_sums():
    metrics = Metrics()
    for replica, running in (("a", 2), ("b", 3)):
        metrics.update_stats(
            "demo",
            {"replica_id": replica, "num_running": running, "kv_usage": 0.5,
             "num_preemptions": 4, "prefix_cache_queries": 10},
        )  # fmt: skip
    assert _lines(metrics, "num_requests_running") == [
        'num_requests_running{model_name="demo"} 5.0'
    ]
    metrics.forget_departed(None)  # who runs is not known: nothing changes
    assert _lines(metrics, "num_requests_running") == [
        'num_requests_running{model_name="demo"} 5.0'
    ]
    metrics.forget_departed({"a", "someone-else"})  # b was scaled in
    assert _lines(metrics, "num_requests_running") == [
        'num_requests_running{model_name="demo"} 2.0'
    ]
    assert _lines(metrics, "npu_cache_usage_perc") == [
        'npu_cache_usage_perc{model_name="demo"} 0.5'
    ]
    assert _lines(metrics, "num_preemptions_total") == [
        'num_preemptions_total{model_name="demo"} 8.0'
    ]
    # a report of b's that comes late (its last stream's final chunk) is not taken
    metrics.update_stats("demo", {"replica_id": "b", "num_running": 1, "num_preemptions": 5})
    metrics.update_stats(
        "demo",
        {"replica_id": "a", "num_running": 0, "num_preemptions": 6, "prefix_cache_queries": 10},
    )
    assert _lines(metrics, "num_requests_running") == [
        'num_requests_running{model_name="demo"} 0.0'
    ]
    assert _lines(metrics, "num_preemptions_total") == [
        'num_preemptions_total{model_name="demo"} 10.0'
    ]
    metrics.forget_departed(set())  # a left too: the counters hold, the gauges are empty
    assert _lines(metrics, "num_preemptions_total") == [
        'num_preemptions_total{model_name="demo"} 10.0'
    ]
    assert _lines(metrics, "prefix_cache_queries_total") == [
        'prefix_cache_queries_total{model_name="demo"} 20.0'
    ]
    assert _lines(metrics, "npu_cache_usage_perc") == [
        'npu_cache_usage_perc{model_name="demo"} 0.0'
    ]


def test_an_app_in_process_counts_its_replicas_while_ray_runs_other_replicas(client, monkeypatch):
    """Ray's list of running replicas is about replicas over Ray: an app whose replicas are in
    its own process (a test worker that also started Ray, an offline tool) keeps counting
    its own, not treating them as departed."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    actor = {"name": "SERVE_REPLICA::serve_app#ModelReplica-demo#abc123", "namespace": "serve"}
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [actor])

    def queries() -> float:
        text = client.get("/metrics").text
        lines = [x for x in text.splitlines() if x.startswith("prefix_cache_queries_total{")]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines)

    before = queries()
    body = {"model": "demo", "prompt": "x " * 40, "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert queries() > before
