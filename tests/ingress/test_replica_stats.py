"""/metrics asks every running replica of a deployment for its stats (ingress/replica_stats.py),
through a handle that picks the replica of each call itself."""

from __future__ import annotations

import asyncio

from serve_app.ingress.replica_stats import ROUNDS, serve_replicas, stats_of_each


class Handle:
    """A deployment handle's stats calls, each answered by the next replica of `picks`."""

    def __init__(self, picks: list[str]) -> None:
        self.picks, self.calls = iter(picks), 0

    async def call(self) -> dict:
        self.calls += 1
        return {"replica_id": next(self.picks), "num_running": 0}


def _ids(answers: list[dict]) -> list[str]:
    return sorted(a["replica_id"] for a in answers)


def test_every_running_replica_answers_also_the_ones_the_router_skipped():
    handle = Handle(["a", "a", "b", "c", "c"])  # the first round reaches two of three
    answers = asyncio.run(stats_of_each(handle.call, {"a", "b", "c"}))
    assert _ids(answers) == ["a", "b", "c"] and handle.calls == 4  # 3, then 1 for the missing


def test_a_replica_no_call_reaches_costs_a_few_rounds_only():
    """A draining or starting replica runs but takes no calls: the others are asked again
    for it, ROUNDS times at most."""
    handle = Handle(["a"] * 100)
    answers = asyncio.run(stats_of_each(handle.call, {"a", "gone"}))
    assert _ids(answers) == ["a"] and handle.calls == 2 + (ROUNDS - 1)


def test_without_the_running_replicas_one_call():
    handle = Handle(["a", "b"])
    assert _ids(asyncio.run(stats_of_each(handle.call, None))) == ["a"] and handle.calls == 1


def test_without_ray_who_runs_is_not_known(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (a test worker may have Ray up)
    assert serve_replicas() is None
