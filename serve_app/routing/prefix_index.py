"""Which replica has recently seen which prompt prefix, by KV block.

A prompt is cut into blocks of the engine's block size, and each full block is named by a hash
of it and every block before it (as the engines' prefix caches name their blocks), so one
lookup per block answers "which replicas hold the prompt up to here". The index forgets the
least recently used blocks past its capacity, as the replicas' caches evict theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

# what a model replica's record_routing_stats reports: RecentBlocks.snapshot()
ROUTING_STATS_KEY = "prefix_blocks"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `token_ids`."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, *token_ids[start : start + block_size]))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    def __init__(self, block_size: int, capacity_blocks: int = 200_000) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._holders: OrderedDict[int, set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[int], candidates: Iterable[Hashable]) -> tuple[set, int]:
        """The candidates that hold the longest prefix of the prompt (`block_hashes`) among
        them, and how many blocks long it is; (empty, 0) when none holds its first block."""
        best: set = set()
        depth = 0
        alive = set(candidates)
        for block in hashes:
            holders = self._holders.get(block)
            holding = alive & holders if holders else set()
            if not holding:
                break
            best, depth, alive = holding, depth + 1, holding
        return best, depth

    def insert(self, hashes: Sequence[int], replica: Hashable) -> None:
        """`replica` now holds these blocks (the prompt it was just sent)."""
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = {replica}
            else:
                holders.add(replica)
                self._holders.move_to_end(block)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def drop(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (their caches went with them)."""
        gone = set(replicas)
        if not gone:
            return
        for block in list(self._holders):
            holders = self._holders[block] - gone
            if holders:
                self._holders[block] = holders
            else:
                del self._holders[block]


class RecentBlocks:
    """The blocks of the prompts a model replica was sent lately, most recent last: what it
    reports to the routers of every ingress (`record_routing_stats`), so that a router also
    learns what the other ingress replicas sent it."""

    def __init__(self, block_size: int, capacity_blocks: int = 8192) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, token_ids: Sequence[int]) -> None:
        for block in block_hashes(token_ids, self.block_size):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def snapshot(self) -> list[int]:
        return list(self._blocks)
