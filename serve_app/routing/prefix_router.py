"""Ray Serve request router that sends a request to the replica that already caches its prefix.

The model replicas' engines keep the KV of recent prompts (prefix caching); a request whose
prompt starts as an earlier one did (a chat's next turn, a shared system prompt, an agent's
growing context) is prefilled only past the shared part on the replica that served the earlier
one. Ray Serve's default router (power of two choices) ignores that; this one, set as the model
deployments' `request_router_config`, remembers which replica each prompt went to (by KV block,
prefix_index.py) and ranks the replicas holding the longest prefix of a new prompt first, two
random others after: Ray Serve sends the request to the least loaded replica of the first rank
that has room, so a full replica is passed over. Where the replicas holding the prefix are
busier than the least loaded replica by more than `imbalance` requests, or nothing matches, it
falls back to two random choices, as the default does.

Each handle (each ingress replica) keeps its own index of what it sent where, and learns what
the other ingress replicas sent from the model replicas themselves: each reports the blocks of
the prompts it was sent lately through Ray Serve's routing stats (every
`request_routing_stats_period_s`).
"""

from __future__ import annotations

import random

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from serve_app.routing.prefix_index import ROUTING_STATS_KEY, PrefixIndex, block_hashes


def prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt's token ids of a model replica call (generate or prefill: a ReplicaRequest;
    decode: a DecodeRequest around one); None for calls without a prompt (stats, health)."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        request = getattr(arg, "request", arg)
        ids = getattr(request, "prompt_token_ids", None)
        if ids is not None:
            return ids
    return None


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self, block_size: int = 16, imbalance: int = 2, capacity_blocks: int = 200_000
    ) -> None:
        self.index = PrefixIndex(block_size, capacity_blocks)
        self.imbalance = imbalance
        self._reported: dict = {}  # replica id -> the newest block of its last report learnt

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        ids = prompt_of(pending_request)
        return block_hashes(ids, self.index.block_size) if ids else []

    def _load(self, replica: RunningReplica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)

    def _balanced(self, holders: list[RunningReplica], everyone: list[RunningReplica]) -> bool:
        """Whether the least loaded holder is within `imbalance` requests of the least loaded
        replica (unknown loads count as balanced: Ray Serve probes them as it picks)."""
        known = [q for q in map(self._load, everyone) if q is not None]
        held = [q for q in map(self._load, holders) if q is not None]
        if not known or not held:
            return True
        return min(held) - min(known) <= self.imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = self._hashes(pending_request)
        if not hashes or len(candidate_replicas) < 2:
            return [two]
        by_id = {r.replica_id: r for r in candidate_replicas}
        holder_ids, _depth = self.index.match(hashes, by_id)
        holders = [by_id[i] for i in holder_ids]
        if not holders or not self._balanced(holders, candidate_replicas):
            return [two]
        return [holders, [r for r in two if r.replica_id not in holder_ids]]

    def _get_pending_request_matching_metadata(self, request_metadata=None):
        """The waiting request a chosen replica goes to: the one it was chosen for; else (FIFO)
        the oldest. The calls one request makes (an ingress sending each prompt of a batch)
        share Ray Serve's internal request id, which its match by id alone finds once: without
        the fallback, the second call was never sent."""
        return self._get_pending_request_matching_internal_request_id(request_metadata)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        hashes = self._hashes(pending_request)
        if hashes:
            self.index.insert(hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop([replica_id])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """New replicas, or new routing stats: forget the replicas that left, learn what each
        replica reports it was sent (through any ingress)."""
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        gone = before - set(self.curr_replicas)
        self.index.drop(gone)
        for replica_id in gone:
            self._reported.pop(replica_id, None)
        self.learn(replicas)

    def learn(self, replicas: list[RunningReplica]) -> None:
        """Add what each replica's routing stats report it was sent, where that is new."""
        for replica in replicas:
            blocks = (replica.routing_stats or {}).get(ROUTING_STATS_KEY)
            if blocks and self._reported.get(replica.replica_id) != blocks[-1]:
                self._reported[replica.replica_id] = blocks[-1]
                self.index.insert(blocks, replica.replica_id)
