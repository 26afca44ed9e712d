"""KV block pool and sequence-level block management: pure bookkeeping, no model."""

from serve_app.engine.block_pool import BlockPool
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.sequence import Sequence


def test_allocate_reports_no_room_instead_of_raising():
    pool = BlockPool(4, 16)
    assert pool.allocate(3) is not None
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1


def test_release_returns_blocks_and_reference_counts_share():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.release(blocks)
    assert pool.num_free_blocks == 2
    pool.release(blocks)
    assert pool.num_free_blocks == 4


def test_allocation_covers_new_tokens_and_rounds_up_to_blocks():
    kv = KVCacheManager(BlockPool(8, 4))
    seq = Sequence(list(range(10)), 10)
    assert kv.blocks_needed(seq, 10) == 3
    assert kv.allocate(seq, 10)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 10
    seq.token_ids.append(99)
    assert kv.blocks_needed(seq, 1) == 0  # position 10 fits in block 2
    kv.free(seq)
    assert kv.pool.num_free_blocks == 8


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(BlockPool(8, 4))
    parent = Sequence(list(range(6)), 6)
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = kv.fork(parent)
    assert child.block_table == parent.block_table
    assert kv.pool.num_free_blocks == 6
    child.token_ids.append(7)
    assert kv.allocate(child, 1)  # writes position 6 into the shared block 1: copy it
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert child.block_table[1] != parent.block_table[1]
    assert kv.pending_copies == [(parent.block_table[1], child.block_table[1])]
    parent.token_ids.append(8)
    kv.allocate(parent, 1)  # now the sole owner of its block: no copy
    assert len(kv.pending_copies) == 1
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 8


def test_prefix_cache_reuses_full_blocks_and_keeps_the_last_token_to_compute():
    kv = KVCacheManager(BlockPool(16, 4))
    first = Sequence(list(range(12)), 12)
    kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.commit(first)
    kv.free(first)  # cached blocks survive their owner while nobody needs the room
    second = Sequence(list(range(12)) + [50], 13)
    kv.match_prefix(second)
    assert second.num_computed_tokens == 12
    assert second.block_table == first_blocks(kv, 3)
    same = Sequence(list(range(12)), 12)
    kv.match_prefix(same)
    assert same.num_computed_tokens == 8  # the last block would leave nothing to compute
    other = Sequence([1] + list(range(1, 12)), 12)
    kv.match_prefix(other)
    assert other.num_computed_tokens == 0
    assert kv.pool.num_cache_hits == 5
    # every full block of every prompt is a query, whether or not an earlier one missed: the
    # hit rate is the share of the prompts' blocks reused (3 + 2 of 3 + 2 + 2)
    assert kv.pool.num_cache_queries == 7


def first_blocks(kv, n):
    return [kv.pool.cached[key] for key in list(kv.pool.cached)[:n]]


def test_cached_blocks_are_evicted_when_room_is_needed():
    kv = KVCacheManager(BlockPool(4, 4))
    seq = Sequence(list(range(16)), 16)
    kv.allocate(seq, 16)
    seq.num_computed_tokens = 16
    kv.commit(seq)
    kv.free(seq)
    assert len(kv.pool.cached) == 4
    assert kv.pool.allocate(4) is not None
    assert not kv.pool.cached
