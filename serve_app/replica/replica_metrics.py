"""A model replica's engine figures, exported per replica through Ray's metrics.

`/metrics` is one ingress replica's view (the engine stats that model replicas reported to it
with their requests). These are every model replica's own, read from its engine every second and
recorded with Ray Serve's metrics, which tag each series with the application, the deployment and
the replica; Ray's metrics agent on each node serves them to Prometheus (Ray adds the `ray_`
prefix), so a dashboard can show each replica, and sum or average them, from one source.
With them, each request's timing on the replica (time to first token, time between tokens, as
its engine measured them) and the tokens it generated: the replica notes each engine output as
it hands it over (`note`, a list append on the event loop) and the same thread records them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from serve_app.engine.outputs import RequestOutput

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

# histograms of the requests' timing on the engine, from its outputs' step metrics: (name, help,
# bucket upper bounds in seconds)
HISTOGRAMS = (
    ("serve_app_time_to_first_token_seconds",
     "Time from a request's arrival at the replica's engine to its first token.",
     (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)),
    ("serve_app_inter_token_latency_seconds", "Time between two tokens of a request.",
     (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)),
)  # fmt: skip
GENERATED = ("serve_app_generation_tokens", "Tokens generated (every choice's).")


class ReplicaMetrics:
    """Reads `stats()` every PERIOD_S on a thread of its own and records it, tagged with the
    model's name and the replica's role, until close()."""

    def __init__(self, model: str, role: str, stats: Callable[[], dict]) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram

        tags = {"model": model, "role": role}
        keys = tuple(tags)
        self._stats = stats
        self._gauges = [(Gauge(n, h, tag_keys=keys), k) for n, k, h in GAUGES]
        self._counters = [(Counter(n, h, tag_keys=keys), k) for n, k, h in COUNTERS]
        self._ttft, self._itl = (Histogram(n, h, list(b), tag_keys=keys) for n, h, b in HISTOGRAMS)
        self._generated = Counter(*GENERATED, tag_keys=keys)
        for metric in [m for m, _ in self._gauges + self._counters] + [
            self._ttft,
            self._itl,
            self._generated,
        ]:
            metric.set_default_tags(dict(tags))  # (Ray Serve adds its own tags to the dict)
        self._last: dict[str, float] = {}
        self._noted: list[tuple] = []  # (step metrics, new tokens) of outputs since record()
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
        noted, self._noted = self._noted, []
        for steps, _ in noted:
            for step in steps:
                if step.prefill_time_ms is not None:
                    self._ttft.observe(step.prefill_time_ms / 1e3)
                elif step.decode_time_ms is not None:
                    self._itl.observe(step.decode_time_ms / 1e3)
        if generated := sum(tokens for _, tokens in noted):
            self._generated.inc(generated)

    def note(self, output: RequestOutput) -> None:
        """An engine output of a request: its steps' timing and its new tokens, recorded with
        the rest (the output itself is not kept: a prefill's carries the prompt's KV)."""
        tokens = sum(len(choice.new_token_ids) for choice in output.outputs)
        self._noted.append((output.step_history or (output.metrics,), tokens))

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.record()
            except Exception:  # noqa: BLE001 (an engine that is going away: the next try)
                logger.debug("recording the replica's metrics failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
