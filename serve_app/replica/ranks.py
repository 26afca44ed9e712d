"""The other ranks of a model split over worldSize devices, as Ray actors.

A model replica is rank 0: its engine (in the replica or in its engine process) drives the
steps. Ranks 1..worldSize-1 are actors this replica starts in its own placement group (Ray
Serve makes one per replica from `placement_group_bundles`: bundle 0 is the replica's, bundle r
rank r's, packed on one node), so they are placed, reserved and released with the replica: when
it is replaced or scaled down, Ray ends the actors it owns with it. A rank that dies fails its
peers' next collective at once; the replica's health check reports it too. A rank that hangs
(its process stopped, or stuck holding the interpreter) fails no collective: its peers wait in
the next one. The health check asks every rank to answer, on a second thread of the actor, and
one that does not within RANK_ANSWER_S is reported hung.
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serve_app.engine.backends.parallel.rendezvous import Rendezvous
from serve_app.engine.config import EngineConfig
from serve_app.engine.host.async_engine import AsyncEngine

# How long a rank may take to answer the health check's call; a live one answers in
# milliseconds, on a loaded machine in a second or two (the call waits for a core).
RANK_ANSWER_S = 10.0


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)  # `serve` blocks one thread
class Rank:
    def serve(self, config: EngineConfig, rank: int) -> None:
        """Load this rank's part of the model and follow rank 0 until it stops (blocks)."""
        from serve_app.engine.backends.parallel.worker import serve

        serve(config, rank)

    def answer(self) -> bool:
        return True


def rank_resources(bundle: dict[str, float]) -> dict:
    """Actor options that take the whole of a placement group bundle."""
    resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    options: dict = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    return options | ({"resources": resources} if resources else {})


class RayRanks:
    """Ranks 1..world-1 of `config`'s model; `config` (returned with the rendezvous filled in)
    is what rank 0's engine is built with."""

    def __init__(self, config: EngineConfig) -> None:
        rendezvous = Rendezvous.here(ray.util.get_node_ip_address())
        self.config = config.replace(tp_rendezvous=rendezvous.address)
        group = get_current_placement_group()
        self.actors, self.runs = [], []
        for rank in range(1, config.world_size):
            options: dict = {"num_cpus": 0}  # outside a placement group: no reservation
            if group is not None and rank < group.bundle_count:
                options = rank_resources(group.bundle_specs[rank])
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                )
            actor = Rank.options(**options).remote()
            self.actors.append(actor)
            self.runs.append(actor.serve.remote(self.config, rank))

    def failure(self) -> str | None:
        """Why a rank has ended (None: all are running); they end only with the replica."""
        done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.runs.index(done[0]) + 1
        try:
            ray.get(done[0])
        except Exception as exc:  # noqa: BLE001 (whatever ended it is the report)
            return f"rank {rank} of worldSize {self.config.world_size} failed: {exc}"
        return f"rank {rank} of worldSize {self.config.world_size} has stopped"

    async def unanswered(self, within_s: float = RANK_ANSWER_S) -> str | None:
        """Why a rank seems hung (None: every rank answered within within_s)."""
        calls = [asyncio.ensure_future(actor.answer.remote()) for actor in self.actors]
        if not calls:
            return None
        _, pending = await asyncio.wait(calls, timeout=within_s)
        for call in pending:
            call.cancel()
        if not pending:
            return None
        rank = next(r for r, call in enumerate(calls, 1) if call in pending)
        return (
            f"rank {rank} of worldSize {self.config.world_size} has not answered in "
            f"{within_s:g} s: it hangs"
        )

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs = [], []


def start_engine(config: EngineConfig) -> tuple[AsyncEngine, RayRanks | None]:
    """The replica's engine (rank 0) and, for a model split over several devices, the other
    ranks it drives (started first: they join as it loads)."""
    ranks = RayRanks(config) if config.world_size > 1 else None
    try:
        return AsyncEngine(ranks.config if ranks else config), ranks
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
