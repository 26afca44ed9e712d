"""Iteration-level (continuous) batching.

Each step takes the running requests, then admits waiting ones, in (priority, arrival) order,
within maxBatchSize sequences, maxPrefillTokens prompt tokens and maxPrefillBatchSize prompts.
Prompts longer than the token budget are chunked: nothing special, the same catch-up rule
continues them next step. When blocks run out, the newest, lowest-priority running request is
preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from serve_app.engine.config import EngineConfig
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.sequence import Request, RequestStatus, Sequence


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key), request)

    def remove(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for seq in request.seqs:
            self.kv.free(seq)

    def _plan(self, request: Request, budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        """Tokens to compute per sequence this step, and the prompt budget they use.

        Several sequences of one request (forks, beams) sample together. After a preemption
        they are recomputed one at a time, each stopping one token short, so that the later ones
        find the shared prompt blocks in the prefix cache instead of each needing its own copy.
        """
        seqs = request.seqs
        behind = [s for s in seqs if s.num_computed_tokens < s.num_tokens - 1]
        if len(seqs) > 1 and behind:
            seq, short = behind[0], 1
        elif len(seqs) == 1:
            seq, short = seqs[0], 0
        else:  # all caught up: one token each, sampled together
            return [(s, s.num_tokens - s.num_computed_tokens) for s in seqs], 0
        self.kv.match_prefix(seq)  # adopts cached blocks only while it holds none
        need = seq.num_tokens - short - seq.num_computed_tokens
        if need == 1:  # a decode-like step costs no prompt budget
            return [(seq, 1)], 0
        n = min(need, budget)  # prompt work, bounded by the budget
        return ([(seq, n)], n) if n > 0 else ([], 0)

    def _preempt(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.free(seq)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def _try_allocate(self, plan: list[tuple[Sequence, int]]) -> bool:
        need = sum(self.kv.blocks_needed(seq, n) for seq, n in plan)
        if need > self.kv.pool.num_free_blocks:
            return False
        for seq, n in plan:
            ok = self.kv.allocate(seq, n)
            assert ok, "allocation failed after the room check"
        return True

    def _add_to_batch(self, batch: ScheduledBatch, request: Request, plan) -> None:
        batch.requests.append(request)
        for seq, n in plan:
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)

    def schedule(self) -> ScheduledBatch:
        config, batch = self.config, ScheduledBatch()
        budget, num_prefills = config.max_prefill_tokens, 0
        queue = sorted(self.running, key=lambda r: r.sort_key)
        kept: list[Request] = []
        while queue:
            request = queue.pop(0)
            is_prefill = any(s.num_computed_tokens < s.num_tokens - 1 for s in request.seqs)
            if is_prefill and num_prefills >= config.max_prefill_batch_size:
                kept.append(request)
                continue
            plan, used = self._plan(request, budget)
            if not plan:
                kept.append(request)
                continue
            while not self._try_allocate(plan):
                if not queue:  # nobody newer left to make room: step back ourselves
                    self._preempt(request)
                    batch.num_preempted += 1
                    break
                self._preempt(queue.pop())
                batch.num_preempted += 1
            else:
                kept.append(request)
                self._add_to_batch(batch, request, plan)
                budget -= used
                num_prefills += is_prefill
        self.running = kept
        if batch.num_preempted:
            return batch  # no admissions while the pool is under pressure
        num_seqs = self.num_running_seqs
        while self.waiting:
            request = self.waiting[0]
            if num_seqs + len(request.seqs) > config.max_batch_size:
                break
            if num_prefills >= config.max_prefill_batch_size or budget <= 0:
                break
            plan, used = self._plan(request, budget)
            if not plan or not self._try_allocate(plan):
                for seq in request.seqs:  # give back prefix blocks while we wait
                    self.kv.free(seq)
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            self._add_to_batch(batch, request, plan)
            budget -= used
            num_prefills += 1
            num_seqs += len(request.seqs)
        return batch
