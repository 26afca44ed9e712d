"""The prefix-aware request router's choices, without Ray: the index of which replica holds
which prompt prefix, and the ranks the router gives Ray Serve (the replicas holding the longest
prefix first; two random ones when nothing matches or the holders are too busy)."""

import asyncio
from types import SimpleNamespace

from serve_app.routing.prefix_index import PrefixIndex, block_hashes
from serve_app.routing.prefix_router import PrefixAwareRouter, prompt_of


def test_blocks_are_named_by_everything_before_them():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens are no full block
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first
    assert block_hashes(list(range(32)), 16) == a


def test_the_longest_held_prefix_wins():
    index = PrefixIndex(block_size=4)
    system = list(range(8))
    index.insert(block_hashes(system + [50, 51, 52, 53], 4), "r1")
    index.insert(block_hashes(system + [60, 61, 62, 63], 4), "r2")
    turn = block_hashes(system + [60, 61, 62, 63, 70, 71, 72, 73], 4)
    assert index.match(turn, ["r1", "r2"]) == ({"r2"}, 3)
    assert index.match(turn, ["r1"]) == ({"r1"}, 2)  # only the shared system prompt
    assert index.match(block_hashes([9] * 8, 4), ["r1", "r2"]) == (set(), 0)
    index.drop(["r2"])
    assert index.match(turn, ["r1", "r2"]) == ({"r1"}, 2)


def test_the_least_recently_used_blocks_are_forgotten_first():
    index = PrefixIndex(block_size=2, capacity_blocks=4)
    old, new = block_hashes([1, 2, 3, 4], 2), block_hashes([5, 6, 7, 8], 2)
    index.insert(old, "r1")
    index.insert(new, "r2")
    index.insert(old, "r1")  # used again: the newest
    index.insert(block_hashes([9, 10], 2), "r3")
    assert len(index) == 4
    assert index.match(old, ["r1", "r2", "r3"]) == ({"r1"}, 2)
    assert index.match(new, ["r1", "r2", "r3"]) == (set(), 0)  # its head went first


class Loads:
    def __init__(self, loads):
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id)


def _router(loads=None, imbalance=8):
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)  # the policy alone, no Ray handle
    router.initialize_state(block_size=4, imbalance=imbalance)
    router._replica_queue_len_cache = Loads(loads or {})
    return router


def _request(ids, decode=False):
    request = SimpleNamespace(prompt_token_ids=ids)
    return SimpleNamespace(args=[SimpleNamespace(request=request) if decode else request])


REPLICAS = [SimpleNamespace(replica_id=f"r{i}", routing_stats={}) for i in range(4)]


def _choose(router, pending):
    ranks = asyncio.run(router.choose_replicas(REPLICAS, pending))
    return [[r.replica_id for r in rank] for rank in ranks]


def test_a_conversation_goes_back_to_the_replica_that_holds_it():
    router = _router()
    first = _request(list(range(10)))
    assert len(_choose(router, first)[0]) == 2  # nothing known yet: two random ones
    router.on_request_routed(first, "r2", None)
    later = _request(list(range(10)) + [7] * 9)
    assert _choose(router, later)[0] == ["r2"]
    assert _choose(router, _request(list(range(10)) + [1], decode=True))[0] == ["r2"]
    # the second rank: others, should r2 have no room
    assert "r2" not in sum(_choose(router, later)[1:], [])


def test_busy_holders_are_passed_over_and_short_prompts_spread():
    router = _router({"r0": 0, "r1": 0, "r2": 12, "r3": 1}, imbalance=8)
    held = _request(list(range(12)))
    router.on_request_routed(held, "r2", None)
    ranks = _choose(router, held)
    assert len(ranks) == 1 and len(ranks[0]) == 2  # r2 is 12 requests busier: load balance
    router._replica_queue_len_cache = Loads({"r0": 0, "r2": 5})
    assert _choose(router, held)[0] == ["r2"]
    assert len(_choose(router, _request([1, 2, 3]))[0]) == 2  # under a block: nothing to match
    assert prompt_of(SimpleNamespace(args=[])) is None


def test_replicas_that_leave_are_forgotten():
    router = _router()
    held = _request(list(range(12)))
    router.on_request_routed(held, "r3", None)
    router.index.drop(["r3"])
    assert len(_choose(router, held)[0]) == 2


def test_what_a_replica_reports_it_was_sent_routes_the_next_turn_there():
    """Another ingress replica sent the first turn: this router learns it from the replica's
    routing stats (RecentBlocks, reported through Ray Serve) and sends the next turn there."""
    from serve_app.routing.prefix_index import ROUTING_STATS_KEY, RecentBlocks

    recent = RecentBlocks(block_size=4, capacity_blocks=3)
    recent.add(list(range(12)))
    recent.add([50] * 8)  # the oldest block goes: three at most
    assert len(recent.snapshot()) == 3
    router = _router()
    stats = {ROUTING_STATS_KEY: recent.snapshot()}
    router.learn([SimpleNamespace(replica_id="r1", routing_stats=stats), REPLICAS[0]])
    assert _choose(router, _request([50] * 8 + [1] * 4))[0] == ["r1"]
    assert len(_choose(router, _request(list(range(12))))[0]) == 2  # forgotten by r1's report
