"""A model replica's engine figures, exported per replica through Ray's metrics.

`/metrics` is one ingress replica's view (the engine stats that model replicas reported to it
with their requests). These are every model replica's own, read from its engine every second and
recorded with Ray Serve's metrics, which tag each series with the application, the deployment and
the replica; Ray's metrics agent on each node serves them to Prometheus (Ray adds the `ray_`
prefix), so a dashboard can show each replica, and sum or average them, from one source.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

PERIOD_S = 1.0

# (name, engine stats key, help): gauges, the latest value
GAUGES = (
    ("serve_app_requests_running", "num_running", "Requests in the engine's running batch."),
    ("serve_app_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("serve_app_kv_cache_usage", "kv_usage", "KV cache blocks in use, 0..1."),
)
# counters: the engine's running totals, recorded as increments
COUNTERS = (
    ("serve_app_prefix_cache_queries", "prefix_cache_queries", "Prompt blocks looked up."),
    ("serve_app_prefix_cache_hits", "prefix_cache_hits", "Prompt blocks found cached."),
    ("serve_app_preemptions", "num_preemptions", "Sequences preempted (recomputed later)."),
    ("serve_app_engine_steps", "num_steps", "Engine steps run."),
)


class ReplicaMetrics:
    """Reads `stats()` every PERIOD_S on a thread of its own and records it, tagged with the
    model's name and the replica's role, until close()."""

    def __init__(self, model: str, role: str, stats: Callable[[], dict]) -> None:
        from ray.serve.metrics import Counter, Gauge

        tags = {"model": model, "role": role}
        self._stats = stats
        self._gauges = [(Gauge(n, h, tag_keys=tuple(tags)), k) for n, k, h in GAUGES]
        self._counters = [(Counter(n, h, tag_keys=tuple(tags)), k) for n, k, h in COUNTERS]
        for metric, _ in self._gauges + self._counters:
            metric.set_default_tags(dict(tags))  # (Ray Serve adds its own tags to the dict)
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-metrics", daemon=True)
        self._thread.start()

    def record(self) -> None:
        stats = self._stats()
        for gauge, key in self._gauges:
            gauge.set(float(stats.get(key) or 0))
        for counter, key in self._counters:
            total = float(stats.get(key) or 0)
            if total > self._last.get(key, 0.0):
                counter.inc(total - self._last.get(key, 0.0))
            self._last[key] = total

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.record()
            except Exception:  # noqa: BLE001 (an engine that is going away: the next try)
                logger.debug("recording the replica's metrics failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
