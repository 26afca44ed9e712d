"""Prometheus metrics at /metrics, MindIE's metric names, label model_name.

Request-level histograms and counters are observed in the ingress as requests finish; the engine
gauges (running, waiting, KV usage, preemptions, prefix-cache hit rate) come from the stats that
each model replica attaches to its final chunk and to /metrics-time polls, kept per replica and
summed (KV usage averaged) across replicas. A replica that left (scaled in, replaced: its Ray
Serve actor is gone) stops counting in the gauges, and its counters' last totals stay in the
sums, so that a counter never goes down.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STALE_S = 300.0  # a replica silent for this long (scaled down, dead) stops counting


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]

        def counter(name, doc):
            return Counter(name, doc, label, registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry)

        self.received = counter("request_received", "Requests received.")
        self.success = counter("request_success", "Requests that finished normally.")
        self.failed = counter("request_failed", "Requests that ended with an error.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time to first token.",
            (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10),
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Time per output token after the first.",
            (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "End-to-end request latency.",
            (1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60),
        )
        token_buckets = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        # inferMode dmi: where the time to first token goes, and what the KV hand-off costs
        self.pd_ttft_stage = Histogram(
            "pd_ttft_stage_seconds",
            "PD time to first token by stage: queue, prefill, handoff, first_decode_step.",
            ["model_name", "stage"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.kv_transfers = counter("kv_transfers", "PD KV hand-offs imported by decode.")
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "PD KV bytes handed off.")
        self.kv_recomputed = counter(
            "kv_recomputed", "PD hand-offs whose KV was lost and recomputed on decode."
        )
        self.kv_handoff = histogram(
            "kv_handoff_seconds",
            "PD KV hand-off time: fetch on the decode replica and import into its pool.",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self._replica_stats: dict[str, dict[str, tuple[float, dict]]] = {}
        self._departed: set[str] = set()  # replicas that left: a late report of theirs is dropped
        self._departed_totals: dict[str, dict[str, float]] = {}  # model -> their counters' sums
        self.registry.register(_EngineCollector(self))

    def observe_request(
        self, model, outcome, start, end, first_token_at, num_prompt, num_tokens
    ) -> None:
        """One generation request's end: its outcome, token counts and latencies."""
        (self.success if outcome == "success" else self.failed).labels(model).inc()
        self.prompt_tokens.labels(model).inc(num_prompt)
        self.generation_tokens.labels(model).inc(num_tokens)
        self.request_prompt_tokens.labels(model).observe(num_prompt)
        self.request_generation_tokens.labels(model).observe(num_tokens)
        self.e2e.labels(model).observe(end - start)
        if first_token_at is not None:
            self.ttft.labels(model).observe(first_token_at - start)
            if num_tokens > 1:
                self.tpot.labels(model).observe((end - first_token_at) / (num_tokens - 1))

    def observe_prefill(self, model: str, chunk) -> None:
        """The prefill replica's chunk: queue wait, then the prefill itself."""
        if chunk.steps:
            step = chunk.steps[0]
            queue_s = step.queue_wait_us / 1e6
            self.pd_ttft_stage.labels(model, "queue").observe(queue_s)
            if step.prefill_time_ms is not None:
                prefill_s = max(0.0, step.prefill_time_ms / 1e3 - queue_s)
                self.pd_ttft_stage.labels(model, "prefill").observe(prefill_s)

    def observe_first_decode(self, model: str, chunk) -> None:
        """The decode replica's first chunk: the hand-off and its first step."""
        handoff_ms = getattr(chunk, "handoff_ms", None)
        if handoff_ms is not None:
            self.pd_ttft_stage.labels(model, "handoff").observe(handoff_ms / 1e3)
            self.kv_handoff.labels(model).observe(handoff_ms / 1e3)
            self.kv_transfers.labels(model).inc()
            self.kv_transfer_bytes.labels(model).inc(getattr(chunk, "kv_bytes", 0) or 0)
        if getattr(chunk, "kv_recomputed", False):
            self.kv_recomputed.labels(model).inc()
        if chunk.steps and chunk.steps[0].decode_time_ms is not None:
            step_s = chunk.steps[0].decode_time_ms / 1e3
            self.pd_ttft_stage.labels(model, "first_decode_step").observe(step_s)

    def update_stats(self, model: str, stats: dict | None) -> None:
        if stats:
            replica = str(stats.get("replica_id", ""))
            if replica not in self._departed:
                self._replica_stats.setdefault(model, {})[replica] = (time.monotonic(), stats)

    def forget_departed(self, alive: set[str] | None) -> None:
        """Replicas not in `alive` (the ids of the replicas running now; None: not known) have
        left: their gauges go, their counters' totals are kept."""
        if alive is None:
            return
        for model, replicas in self._replica_stats.items():
            for replica in [r for r in replicas if r and r not in alive]:
                _, stats = replicas.pop(replica)
                self._departed.add(replica)
                totals = self._departed_totals.setdefault(model, {})
                for key in COUNTER_KEYS:
                    totals[key] = totals.get(key, 0.0) + float(stats.get(key) or 0)

    def models(self) -> list[str]:
        return list(self._replica_stats)

    def live_stats(self, model: str) -> list[dict]:
        now = time.monotonic()
        return [s for t, s in self._replica_stats.get(model, {}).values() if now - t < _STALE_S]

    def departed_totals(self, model: str) -> dict[str, float]:
        return self._departed_totals.get(model, {})

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        families = [
            (metric_type(name, doc, labels=["model_name"]), value, combine)
            for metric_type, name, doc, value, combine in _ENGINE_METRICS
        ]
        for model in self.metrics.models():
            stats = self.metrics.live_stats(model)
            counted = [*stats, self.metrics.departed_totals(model)]
            for family, value, combine in families:
                of = counted if isinstance(family, CounterMetricFamily) else stats
                family.add_metric([model], combine([float(value(s)) for s in of]))
        for family, _, _ in families:
            yield family


def _hit_rate(stats: dict) -> float:
    queries = stats.get("prefix_cache_queries") or 0
    return (stats.get("prefix_cache_hits") or 0) / queries if queries else 0.0


def _key(name: str):
    def value(stats: dict) -> float:
        return stats.get(name, 0)

    value.key = name  # (the counters' keys: what a departed replica's totals keep)
    return value


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# (type, name, help, value of one replica's stats, how replicas combine): engine facts that each
# replica reports in its stats; counters are the replicas' running totals, summed.
_ENGINE_METRICS = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
     _key("num_running"), sum),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.",
     _key("num_waiting"), sum),
    (GaugeMetricFamily, "num_requests_swapped", "Requests swapped to host memory.",
     _key("num_swapped"), sum),
    (GaugeMetricFamily, "npu_cache_usage_perc", "KV cache usage, 0..1.", _key("kv_usage"), _mean),
    (GaugeMetricFamily, "npu_prefix_cache_hit_rate", "Prefix cache hit rate, 0..1.", _hit_rate,
     _mean),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
     _key("prefix_cache_queries"), sum),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt blocks found in the prefix cache.",
     _key("prefix_cache_hits"), sum),
    (CounterMetricFamily, "num_preemptions", "Preemptions (recompute) so far.",
     _key("num_preemptions"), sum),
    (CounterMetricFamily, "cpu_chunks_step_loop",
     "engineSpareCpus: chunks of the shared CPU kernels the engine's step loop computed.",
     _key("cpu_chunks_step_loop"), sum),
    (CounterMetricFamily, "cpu_chunks_helpers",
     "engineSpareCpus: chunks of the shared CPU kernels the helpers on spare cores computed.",
     _key("cpu_chunks_helpers"), sum),
    (CounterMetricFamily, "cpu_chunks_taken_back",
     "engineSpareCpus: chunks a helper claimed that the step loop finished (the helper was "
     "preempted or slower).", _key("cpu_chunks_taken_back"), sum),
    (CounterMetricFamily, "kv_lost",
     "PD hand-offs whose KV never reached the decode replica (then recomputed or failed, per "
     "kvLossPolicy).", _key("num_kv_lost"), sum),
)  # fmt: skip
# the engine stats keys of the counters (each read with _key)
COUNTER_KEYS = [
    value.key for kind, _, _, value, _ in _ENGINE_METRICS if kind is CounterMetricFamily
]
