"""Whether a model has a replica that can take a request now, as Ray Serve's controller last said.

A request for a model none of whose replicas is running (all of them loading, or being replaced
after a failure) would otherwise queue in Ray Serve's router until one is: minutes for a large
model, past the request's own timeout. Instead it is refused at once with 503 in its family's
shape, saying so, and the client retries. A model scaled to zero (no replica at all, none
starting) is let through: the queued request is what makes Ray Serve start one.

The controller is asked at most once a second, and only while requests come: each request reads
what the last answer said, waiting only for the very first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

logger = logging.getLogger(__name__)

REFRESH_S = 1.0
# replica states that will become RUNNING without a new request
_COMING = ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")


class Availability:
    """deployments: model name -> the names of its replica deployments (one colocated, or a
    prefill and a decode one)."""

    def __init__(self, app_name: str, deployments: dict[str, list[str]]) -> None:
        self.app_name = app_name
        self.deployments = deployments
        self._down: dict[str, str] = {}  # model -> why it cannot take a request now
        self._asked_at = -math.inf
        self._asking: asyncio.Future | None = None

    async def unavailable(self, model: str) -> str | None:
        """Why `model` cannot take a request now (None: it can)."""
        now = time.monotonic()
        first = self._asking is None
        if now - self._asked_at >= REFRESH_S and (first or self._asking.done()):
            self._asked_at = now
            self._asking = asyncio.ensure_future(self._ask())
        if first:
            await asyncio.shield(self._asking)
        return self._down.get(model)

    async def _ask(self) -> None:
        from ray import serve

        try:
            status = await asyncio.to_thread(serve.status)
        except Exception as exc:  # noqa: BLE001 (the controller is busy or gone: keep the last)
            logger.debug("replica states not refreshed: %s", exc)
            return
        app = status.applications.get(self.app_name)
        deployments = app.deployments if app is not None else {}
        self._down = {
            model: f"model {model!r} has no replica ready yet ({deployment}: {states}); retry later"
            for model, names in self.deployments.items()
            for deployment in names
            if (states := _waiting(deployments.get(deployment)))
        }


def _waiting(deployment) -> str | None:
    """'2 starting' where no replica of the deployment runs and some are on their way; None
    where one runs, or none is coming (scaled to zero: a request starts one)."""
    if deployment is None:
        return None
    states = {str(getattr(k, "value", k)): n for k, n in deployment.replica_states.items()}
    if states.get("RUNNING", 0) > 0:
        return None
    coming = {state.lower(): states[state] for state in _COMING if states.get(state)}
    return ", ".join(f"{n} {state}" for state, n in coming.items()) or None
