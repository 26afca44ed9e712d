"""Iteration-level (continuous) batching.

Each step takes the running requests, then admits waiting ones, in (priority, arrival) order,
within maxBatchSize sequences, maxPrefillTokens prompt tokens and maxPrefillBatchSize prompts.
Prompts longer than the token budget are chunked: nothing special, the same catch-up rule
continues them next step. When blocks run out, the newest, lowest-priority running request is
preempted: its blocks are freed and it is recomputed later.

A PD decode brings its prompt's KV from another engine: it waits for KV (WAITING_FOR_KV) until
the pool has room for it, oldest first, before anything else is scheduled; from then on it is
an ordinary waiting request whose prompt counts as computed. One whose imported first token
already ended it never waits: the next batch hands it back to be reported, with no model work.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from serve_app.engine.config import EngineConfig
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.kv_transfer import KVPayload
from serve_app.engine.sequence import Request, RequestStatus, Sequence


@dataclass(slots=True)
class KVWrite:
    """Imported prompt KV for the runner to write into the blocks just allocated for it."""

    request: Request
    # The blocks as allocated. Should the request lose them again in the same schedule (a waiting
    # request that cannot be admitted gives its blocks back), they still get the KV: the prefix
    # cache already lists them as holding these tokens.
    block_table: list[int]
    payload: KVPayload


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    kv_writes: list[KVWrite] = field(default_factory=list)  # before the forward pass
    ended: list[Request] = field(default_factory=list)  # over on arrival: report, no model work

    @property
    def is_empty(self) -> bool:
        """No forward pass this step (KV writes and ended requests may still be due)."""
        return not self.seqs

    def sampling_positions(self) -> list[int]:
        """Indices of the sequences this step catches up (computed tokens reach all tokens):
        the ones whose last position gives logits to sample from. Asked before the step runs."""
        return [
            i
            for i, (seq, n) in enumerate(zip(self.seqs, self.num_new_tokens, strict=True))
            if seq.num_computed_tokens + n == seq.num_tokens
        ]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting_for_kv: dict[Request, KVPayload] = {}  # oldest first
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.ended: list[Request] = []  # until the next schedule() hands them over
        self.num_preemptions = 0

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet, those still waiting for room for their KV included."""
        return len(self.waiting) + len(self.waiting_for_kv)

    def add(self, request: Request, kv: KVPayload | None = None) -> None:
        """Queue a new request; kv: its prompt's KV from a PD prefill, to be imported."""
        if all(seq.is_finished for seq in request.seqs):
            self.ended.append(request)
        elif kv is not None:
            request.status = RequestStatus.WAITING_FOR_KV
            self.waiting_for_kv[request] = kv
        else:
            self._wait(request)

    def _wait(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key), request)

    def remove(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.ended:
            self.ended.remove(request)
        self.waiting_for_kv.pop(request, None)  # its payload goes with it
        for seq in request.seqs:
            self.kv.free(seq)

    def _import_kv(self, batch: ScheduledBatch) -> None:
        """Allocate blocks for the imported KV, oldest request first, while there is room.

        Their prompt counts as computed from here on (and its full blocks enter the prefix
        cache), so they wait like any request whose next step samples; the batch tells the
        engine to write the KV in before the forward pass that could read it.
        """
        for request, payload in list(self.waiting_for_kv.items()):
            seq = request.seqs[0]
            if not self.kv.allocate(seq, payload.num_tokens):
                return
            seq.num_computed_tokens = payload.num_tokens
            self.kv.commit(seq)
            batch.kv_writes.append(KVWrite(request, list(seq.block_table), payload))
            del self.waiting_for_kv[request]
            self._wait(request)

    def _plan(self, request: Request, budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        """Tokens to compute per sequence this step, and the prompt budget they use.

        Several sequences of one request (forks, beams) sample together. After a preemption
        they are recomputed one at a time, each stopping one token short, so that the later ones
        find the shared prompt blocks in the prefix cache instead of each needing its own copy.
        """
        seqs = request.seqs
        short = 1 if len(seqs) > 1 else 0
        for seq in seqs:
            if seq.num_computed_tokens >= seq.num_tokens - short:
                continue
            self.kv.match_prefix(seq)  # adopts cached blocks only while it holds none
            need = seq.num_tokens - short - seq.num_computed_tokens
            if need > 0:  # a fork the cache restored up to its last token needs nothing more
                break
        else:  # all caught up: one token each, sampled together
            return [(s, s.num_tokens - s.num_computed_tokens) for s in seqs], 0
        if need == 1:  # a decode-like step costs no prompt budget
            return [(seq, 1)], 0
        n = min(need, budget)  # prompt work, bounded by the budget
        return ([(seq, n)], n) if n > 0 else ([], 0)

    def _preempt(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.free(seq)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(request)

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
        config, batch = self.config, ScheduledBatch(ended=self.ended)
        self.ended = []
        if self.waiting_for_kv:  # first: prompts computed elsewhere before this step's new work
            self._import_kv(batch)
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
