"""Which models can take a request now, from Ray Serve's replica states (no Ray: a stand-in for
`serve.status`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.ingress import availability
from serve_app.ingress.availability import Availability


def _status(**states: dict) -> SimpleNamespace:
    deployments = {
        name: SimpleNamespace(replica_states=replica_states)
        for name, replica_states in states.items()
    }
    return SimpleNamespace(applications={"app": SimpleNamespace(deployments=deployments)})


@pytest.fixture
def controller(monkeypatch):
    """What serve.status answers (set `.now`), and how many times it was asked."""
    from ray import serve

    state = SimpleNamespace(now=_status(), asked=0)

    def status():
        state.asked += 1
        return state.now

    monkeypatch.setattr(serve, "status", status)
    return state


def test_a_model_with_no_running_replica_but_some_coming_is_unavailable(controller, monkeypatch):
    monkeypatch.setattr(availability, "REFRESH_S", 0.0)
    watch = Availability("app", {"demo": ["ModelReplica"], "pd": ["Prefill-pd", "Decode-pd"]})

    async def ask(model):
        return await watch.unavailable(model)

    controller.now = _status(
        ModelReplica={"STARTING": 2}, **{"Prefill-pd": {"RUNNING": 1}, "Decode-pd": {}}
    )
    reason = asyncio.run(ask("demo"))
    assert reason == "model 'demo' has no replica ready yet (ModelReplica: 2 starting); retry later"
    assert asyncio.run(ask("pd")) is None  # decode scaled to zero: a request starts one
    controller.now = _status(ModelReplica={"RUNNING": 1, "STARTING": 1})

    async def twice():
        await watch.unavailable("demo")  # refreshes in the background
        await asyncio.sleep(0.01)
        return await watch.unavailable("demo")

    assert asyncio.run(twice()) is None


def test_the_controller_is_asked_at_most_once_a_second_and_first_waited_for(controller):
    watch = Availability("app", {"demo": ["ModelReplica"]})
    controller.now = _status(ModelReplica={"RECOVERING": 1})

    async def many():
        return [await watch.unavailable("demo") for _ in range(50)]

    reasons = asyncio.run(many())
    assert all(r and "1 recovering" in r for r in reasons)  # the first answer, waited for
    assert controller.asked == 1


def test_a_controller_that_cannot_answer_leaves_the_last_answer(controller, monkeypatch):
    from ray import serve

    monkeypatch.setattr(availability, "REFRESH_S", 0.0)
    watch = Availability("app", {"demo": ["ModelReplica"]})

    def broken():
        raise ConnectionError("controller gone")

    monkeypatch.setattr(serve, "status", broken)
    assert asyncio.run(watch.unavailable("demo")) is None  # nothing known: let it through
