"""The scheduler alone, without a model: requests of made-up token ids, a block pool, and what
each `schedule()` hands the runner (which sequences, how many new tokens each, preemptions). The
engine's own tests run the same rules through a model."""

from __future__ import annotations

from serve_app.engine.block_pool import BlockPool
from serve_app.engine.config import EngineConfig
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.params import SamplingParams
from serve_app.engine.scheduler import Scheduler
from serve_app.engine.sequence import Request, RequestStatus, Sequence

BLOCK = 4


def scheduler(num_blocks: int = 64, **config) -> Scheduler:
    # limits the config accepts (maxPrefillTokens >= maxInputTokenLen, maxIterTimes <= maxSeqLen);
    # the scheduler itself reads the batch and prefill limits only
    settings = {"block_size": BLOCK, "max_seq_len": 64, "max_input_token_len": 8,
                "max_iter_times": 16, "max_prefill_tokens": 64, **config}  # fmt: skip
    pool = BlockPool(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(EngineConfig(**settings), KVCacheManager(pool))


def request(rid: str, prompt_len: int, priority: int = 3, first: int = 0) -> Request:
    ids = list(range(first, first + prompt_len))
    req = Request(rid, ids, SamplingParams(max_tokens=8), max_output_tokens=8, priority=priority)
    req.seqs = [Sequence(list(ids), prompt_len)]
    return req


def step(sched: Scheduler) -> dict[str, int]:
    """One schedule(), then every planned token computed and, where a sequence caught up, one
    sampled token appended (as the engine's update does): {request id: new tokens}."""
    batch = sched.schedule()
    sampled = set(batch.sampling_positions())
    planned: dict[str, int] = {}
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        owner = next(r for r in batch.requests if seq in r.seqs)
        planned[owner.request_id] = planned.get(owner.request_id, 0) + n
        seq.num_computed_tokens += n
        sched.kv.commit(seq)
        if i in sampled:
            seq.token_ids.append(1000 + seq.num_tokens)
    return planned


def test_prompts_are_chunked_by_the_token_budget_then_decode_one_token_a_step():
    sched = scheduler(max_prefill_tokens=8)
    sched.add(request("a", 20))
    assert [step(sched) for _ in range(4)] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}]
    assert sched.running[0].status == RequestStatus.RUNNING


def test_the_prompt_budget_and_prompt_count_are_shared_and_decodes_cost_none():
    sched = scheduler(max_prefill_tokens=10, max_prefill_batch_size=2)
    for rid, length in (("a", 6), ("b", 6), ("c", 4)):
        sched.add(request(rid, length, first=10 * ord(rid)))
    assert step(sched) == {"a": 6, "b": 4}  # two prompts a step; b gets what a left of 10
    # a decodes (no budget), b's rest and c's prompt share the budget as the two prompts
    assert step(sched) == {"a": 1, "b": 2, "c": 4}


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = scheduler(max_prefill_batch_size=1)
    sched.add(request("low", 4, priority=5, first=100))
    sched.add(request("high", 4, priority=1, first=200))
    sched.add(request("high-later", 4, priority=1, first=300))
    assert list(step(sched)) == ["high"]
    assert list(step(sched)) == ["high", "high-later"]
    assert list(step(sched)) == ["high", "high-later", "low"]


def test_max_batch_size_caps_the_running_sequences():
    sched = scheduler(max_batch_size=2, max_prefill_batch_size=2)
    for rid in "abc":
        sched.add(request(rid, 4, first=10 * ord(rid)))
    assert set(step(sched)) == {"a", "b"}
    assert sched.num_waiting == 1 and set(step(sched)) == {"a", "b"}


def test_out_of_blocks_the_newest_lowest_priority_request_is_preempted_and_recomputed():
    sched = scheduler(num_blocks=4)  # 16 token slots
    sched.add(request("old", 8, first=0))
    sched.add(request("new", 8, first=100))
    assert step(sched) == {"old": 8, "new": 8}  # 2 blocks each, all 4 taken
    # each needs a third block for its next token: "new" steps back so that "old" goes on
    batch = sched.schedule()
    assert batch.num_preempted == 1 and [r.request_id for r in batch.requests] == ["old"]
    new = sched.waiting[0]
    assert new.request_id == "new" and new.num_preemptions == 1
    assert all(seq.block_table == [] for seq in new.seqs)  # its blocks went back to the pool


def test_a_removed_request_gives_its_blocks_back():
    sched = scheduler(num_blocks=8)
    sched.add(request("a", 10))
    step(sched)
    free = sched.kv.pool.num_free_blocks
    assert free < 8
    sched.remove(sched.running[0])
    assert sched.kv.pool.num_free_blocks == 8 and not sched.running
