"""Sequence-level KV block management over the block pool.

Gives sequences the blocks their next tokens need, shares blocks between forks (copy on write
of a shared, partly filled last block), reuses cached prompt prefixes, and frees everything a
sequence held. Copies it decides on are queued for the model runner to perform before the
forward pass that writes into the new block.
"""

from __future__ import annotations

from serve_app.engine.block_pool import BlockPool
from serve_app.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids

    def _needs_copy(self, seq: Sequence) -> bool:
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.pool.ref_counts[seq.block_table[index]] > 1

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table)) + self._needs_copy(seq)

    def worst_case_blocks(self, prompt_len: int, total_len: int, num_seqs: int) -> int:
        """Blocks a request may hold at once: its full prompt blocks shared by all sequences,
        the rest per sequence, plus one copy-on-write block each."""
        shared = prompt_len // self.block_size
        return shared + num_seqs * (-(-total_len // self.block_size) - shared + 1)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq room for its next tokens; False (and nothing changed) if the pool is full."""
        new_blocks = self.pool.allocate(self.blocks_needed(seq, num_new_tokens))
        if new_blocks is None:
            return False
        if self._needs_copy(seq):
            index = seq.num_computed_tokens // self.block_size
            shared, own = seq.block_table[index], new_blocks.pop()
            self.pending_copies.append((shared, own))
            self.pool.release([shared])
            seq.block_table[index] = own
        seq.block_table.extend(new_blocks)
        return True

    def match_prefix(self, seq: Sequence) -> None:
        """Adopt cached blocks for the leading full blocks of a sequence that holds none.

        The last token is always recomputed: its logits are needed to sample the next one.
        """
        if seq.block_table or not self.pool.enable_prefix_caching:
            return
        size, parent = self.block_size, None
        blocks = (seq.num_tokens - 1) // size
        for i in range(blocks):
            key = self.pool.key_of(parent, seq.token_ids[i * size : (i + 1) * size])
            block = self.pool.lookup(key)
            if block is None:
                break
            self.pool.incref([block])
            seq.block_table.append(block)
            seq.block_keys.append(key)
            parent = key
        # every full block of the prompt is a query, those after the first miss too (not looked
        # up): hits / queries is the share of the prompt reused
        self.pool.num_cache_queries += blocks
        seq.num_computed_tokens = len(seq.block_table) * size

    def commit(self, seq: Sequence) -> None:
        """Register blocks that the last step filled, so later prompts can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        size = self.block_size
        parent = seq.block_keys[-1] if seq.block_keys else None
        for i in range(len(seq.block_keys), seq.num_computed_tokens // size):
            key = self.pool.key_of(parent, seq.token_ids[i * size : (i + 1) * size])
            self.pool.register(seq.block_table[i], key)
            seq.block_keys.append(key)
            parent = key

    def fork(self, seq: Sequence) -> Sequence:
        child = seq.fork()
        self.pool.incref(child.block_table)
        return child

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0
