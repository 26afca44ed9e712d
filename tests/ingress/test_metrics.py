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
