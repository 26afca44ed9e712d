"""The KV block pool: fixed-size blocks, reference counts and a prefix cache by chained hashes.

Pure Python, no tensors: the model runner owns the memory, this owns which block is whose.
A block with reference count 0 is free; if it still holds a full, hashed block of some prefix it
stays findable until it is handed out again (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}  # (parent key hash, token tuple) -> block id
        # Free blocks in eviction order: the front is handed out first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_cache_hits = 0  # blocks reused from the prefix cache
        self.num_cache_queries = 0  # prompt blocks that could have been reused (kv_cache.py)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Hand out n blocks, or None (and nothing) when there is no room."""
        if n > len(self.free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.block_keys[block]
            if key is not None:  # evict its stale prefix-cache entry
                self.block_keys[block] = None
                if self.cached.get(key) == block:
                    del self.cached[key]
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks first, so that a prompt's head (the part others share) is evicted last.
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released twice"
            if self.ref_counts[block] == 0:
                self.free[block] = None

    # -- prefix cache ---------------------------------------------------------------------------

    @staticmethod
    def key_of(parent: tuple | None, token_ids: Sequence[int]) -> tuple:
        return (hash(parent), tuple(token_ids))

    def register(self, block: int, key: tuple) -> None:
        """Make a full block findable by its chained key."""
        if not self.enable_prefix_caching or self.block_keys[block] is not None:
            return
        self.block_keys[block] = key
        self.cached.setdefault(key, block)

    def lookup(self, key: tuple) -> int | None:
        block = self.cached.get(key) if self.enable_prefix_caching else None
        if block is not None:
            self.num_cache_hits += 1
        return block
