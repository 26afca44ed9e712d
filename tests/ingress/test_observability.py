"""/metrics, its documentation and the Grafana dashboard agree (no Ray: the metrics object the
ingress serves /metrics from)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from serve_app.ingress.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "cluster" / "grafana-dashboard.json"
DOC = ROOT / "docs" / "observability.md"
RAY_PREFIX = "ray_"  # what Ray's metrics agent puts before the names replicas record


def served() -> dict[str, set[str]]:
    """Every metric family /metrics serves once each has a sample: family name -> the names of
    its series (counters' _total, histograms' _bucket/_sum/_count)."""
    metrics = Metrics()
    for value in vars(metrics).values():
        if isinstance(value, (Counter, Histogram)):
            child = value.labels(*["x"] * len(value._labelnames))
            child.observe(1.0) if isinstance(value, Histogram) else child.inc()
    metrics.update_stats("x", {"replica_id": "r", "num_running": 1})
    text = metrics.render().decode()
    families = text_string_to_metric_families(text)
    # (prometheus_client adds a <name>_created gauge beside each counter and histogram)
    return {
        f.name: {s.name for s in f.samples} for f in families if not f.name.endswith("_created")
    }


def queried() -> set[str]:
    """The metric names the dashboard's queries select, each filtered by the model variable:
    /metrics' by its label model_name, the replicas' own (Ray's ray_ prefix) by model."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = {(n, f) for e in exprs for n, f in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(\w+)=", e)}
    assert exprs and all("$model" in e for e in exprs)
    assert all(f == ("model" if n.startswith(RAY_PREFIX) else "model_name") for n, f in names)
    return {n for n, _ in names}


def recorded_per_replica() -> set[str]:
    """The series each model replica records through Ray's metrics, as Prometheus names them
    (Ray's prefix; counters with _total, histograms by their _bucket series)."""
    from serve_app.replica import replica_metrics

    gauges = {RAY_PREFIX + name for name, _, _ in replica_metrics.GAUGES}
    counters = [name for name, _, _ in replica_metrics.COUNTERS] + [replica_metrics.GENERATED[0]]
    histograms = {f"{RAY_PREFIX}{name}_bucket" for name, _, _ in replica_metrics.HISTOGRAMS}
    return gauges | {f"{RAY_PREFIX}{name}_total" for name in counters} | histograms


def test_every_metric_the_dashboard_queries_is_served():
    series = set().union(*served().values())
    missing = queried() - series - recorded_per_replica()
    assert not missing, f"the dashboard queries metrics nobody serves: {missing}"


def test_every_replica_metric_is_documented_and_on_the_dashboard():
    doc = DOC.read_text()
    names = recorded_per_replica()
    assert names <= queried(), f"not on the dashboard: {names - queried()}"
    base = {n.removesuffix("_total").removesuffix("_bucket") for n in names}
    assert all(f"`{name}`" in doc for name in base), base


def test_every_served_metric_is_documented_and_on_the_dashboard():
    families = served()
    doc = DOC.read_text()
    undocumented = {name for name in families if f"`{name}`" not in doc}
    assert not undocumented, f"docs/observability.md does not list {undocumented}"
    on_dashboard = {family for family, names in families.items() if names & queried()}
    # the spare cores' chunk counters are a CPU tuning aid, not a serving panel
    assert set(families) - on_dashboard == {
        "cpu_chunks_step_loop", "cpu_chunks_helpers", "cpu_chunks_taken_back",
        "num_requests_swapped", "prompt_tokens", "kv_transfers",
    }  # fmt: skip


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(panel["targets"] for panel in dashboard["panels"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model"}
