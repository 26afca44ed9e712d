"""The engine stats of every running replica of a deployment, for /metrics.

A handle sends each call to a replica of Ray Serve's choice (the less loaded of two, the prefix
router's pick), so one call reaches one replica, and an idle replica, whose last report came
with its last request, might not be asked for a long time. Here a scrape asks as many times as
the deployment has replicas (Ray's list of replica actors says which and how many), again for
those that no answer came from, a few rounds at most: each handle's router counts the calls it
sent, so the concurrent calls of one round mostly go to different replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

ROUNDS = 3


def serve_replicas() -> dict[str, set[str]] | None:
    """The ids of the running Ray Serve replicas by "<application>#<deployment>" (each replica's
    actor is named after them); None where Ray is not up in this process."""
    import ray

    if not ray.is_initialized():
        return None
    running: dict[str, set[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith("SERVE_REPLICA::"):
            deployment, _, replica = name.removeprefix("SERVE_REPLICA::").rpartition("#")
            running.setdefault(deployment, set()).add(replica)
    return running


async def stats_of_each(
    call: Callable[[], Awaitable[dict]], replicas: set[str] | None, rounds: int = ROUNDS
) -> list[dict]:
    """Each replica's stats (its `replica_id`'s), asking through `call` until every one of
    `replicas` answered or `rounds` are over; with replicas None (not known), one call."""
    answers: dict[str, dict] = {}
    for _ in range(rounds if replicas else 1):
        missing = len(replicas - answers.keys()) if replicas else 1
        if missing == 0:
            break
        for stats in await asyncio.gather(*(call() for _ in range(missing))):
            answers[str(stats.get("replica_id", ""))] = stats
    return list(answers.values())


async def stats_of_replicas(handles: list, running: dict[str, set[str]] | None) -> list[dict]:
    """Each running replica's stats, of each deployment handle (a model's roles)."""
    found = []
    for handle in handles:
        key = f"{getattr(handle, 'app_name', '')}#{getattr(handle, 'deployment_name', '')}"
        found += await stats_of_each(handle.stats.remote, (running or {}).get(key))
    return found
