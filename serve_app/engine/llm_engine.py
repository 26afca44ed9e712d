"""The engine loop: step() = expire deadlines -> schedule -> run the model -> update requests.

Synchronous and single-threaded; `LLM` drives it for offline batches and `AsyncEngine` runs it
on a thread of its own for serving. For prefill/decode disaggregation one engine runs a prompt
to its first token and exports the prompt's KV (a request with `export_kv`), and another
imports it and continues (a request with `imported`); see `kv_transfer`.
"""

from __future__ import annotations

import time

import torch

from serve_app.engine import kv_transfer
from serve_app.engine.block_pool import BlockPool
from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.model_runner import ModelRunner
from serve_app.engine.outputs import RequestOutput, StepMetrics
from serve_app.engine.params import FinishReason
from serve_app.engine.sampler import Sampler
from serve_app.engine.scheduler import KVWrite, ScheduledBatch, Scheduler
from serve_app.engine.sequence import Request, Sequence, seeded_generator
from serve_app.engine.update import Updater


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.check()
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(config.max_seq_len, hf.max_position_embeddings)
        pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(pool)
        self.scheduler = Scheduler(config, self.kv)
        device = self.runner.device
        sampler = Sampler(config.seed, device)
        self.updater = Updater(
            self.kv, sampler, self.runner.read_kv, self.max_model_len, self._eos_ids(), device
        )
        self.requests: dict[str, Request] = {}
        self.num_kv_imports = 0

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        generation = getattr(self.runner.model, "generation_config", None)
        for source in (self.runner.hf_config, generation):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids (settable: the update stage reads them each step)."""
        return self.updater.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.updater.eos_token_ids = ids

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; RequestRejected, with nothing kept, for input it can never serve.

        `export_kv` (a PD prefill): the request produces exactly one token, and its final output
        carries the prompt's KV and the seeded generator's state for a decode engine.

        `imported` (a PD decode) continues a request another engine prefilled. The sequence
        starts as prompt + [first token] with the prompt's KV written into this pool, so the
        catch-up rule runs the first token next and samples the second; the first token is never
        reported again. Its max_output_tokens counts every output token, the first included, and
        is not clamped by maxIterTimes (the PD rule can make it maxIterTimes + 1). Without KV the
        prompt is recomputed here. When the pool has no room for the KV right now, the request
        waits for room; like any request, it is recomputed only if pool pressure later takes its
        blocks (preemption).
        """
        params, imported = request.params, request.imported
        prompt = self._check_request(request)
        max_output_tokens = self._max_output_tokens(request)
        self._check_fits(len(prompt), max_output_tokens, params.num_seqs)
        first = [] if imported is None else [imported.first_token_id]
        seq = Sequence(
            prompt + first, len(prompt), self._generator(request), num_emitted=len(first)
        )
        tracked = Request(
            request.request_id,
            prompt,
            params,
            max_output_tokens,
            priority=request.priority,
            deadline=request.deadline,
            e2e_start=request.e2e_start,
            export_kv=request.export_kv,
        )
        tracked.arrival_time = request.arrival_time or tracked.arrival_time
        tracked.seqs.append(seq)
        self.requests[request.request_id] = tracked
        if imported is None:
            self.scheduler.add(tracked)
            return
        # Timing of later tokens counts from the hand-off, not from an arrival here.
        tracked.last_token_time = tracked.arrival_time
        # A first token that ends it (EOS, a stop token, a cap of 1): the scheduler only reports it.
        self.updater.check_stop(tracked, seq, imported.first_token_id)
        self.scheduler.add(tracked, imported.kv)

    def _max_output_tokens(self, request: EngineRequest) -> int:
        """A PD prefill makes one token; a PD decode may bring its own cap; else
        min(maxIterTimes, max_tokens)."""
        if request.export_kv:
            return 1
        if request.imported is not None and request.imported.max_output_tokens > 0:
            return request.imported.max_output_tokens
        max_iter_times = self.config.max_iter_times
        return min(max_iter_times, request.params.max_tokens or max_iter_times)

    def _generator(self, request: EngineRequest) -> torch.Generator | None:
        """The request's own generator, when seeded: as a PD prefill's first token left it when
        handed over, else fresh from the seed (seeded, but then not as colocated)."""
        state = request.imported.generator_state if request.imported is not None else None
        if state is None:
            return seeded_generator(request.params.seed, 0, self.runner.device)
        generator = torch.Generator(device=self.runner.device)
        generator.set_state(state)
        return generator

    def _check_request(self, request: EngineRequest) -> list[int]:
        prompt = list(request.prompt_token_ids)
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if not prompt:
            raise RequestRejected("the prompt is empty")
        if not 1 <= request.priority <= 5:
            raise RequestRejected(f"priority must be in [1, 5], got {request.priority}")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) > self.max_model_len - 1:
            raise RequestRejected(
                f"the prompt has {len(prompt)} tokens; at most {self.max_model_len - 1} fit"
                f" (maxSeqLen {self.config.max_seq_len})"
            )
        if request.export_kv or request.imported is not None:
            self._check_handoff(request, len(prompt))
        return prompt

    def _check_handoff(self, request: EngineRequest, prompt_len: int) -> None:
        """A PD prefill or decode runs one sequence; a decode's first token and KV must fit."""
        params, imported = request.params, request.imported
        if params.num_seqs != 1 or params.use_beam_search:
            raise RequestRejected("prefill/decode hand-off supports one sequence (n = best_of = 1)")
        if imported is None:
            return
        if request.export_kv:
            raise RequestRejected("a request either exports its prompt's KV or imports it")
        if not 0 <= imported.first_token_id < self.vocab_size:
            raise RequestRejected(
                f"first token id {imported.first_token_id} is outside the vocabulary"
            )
        if imported.kv is not None:
            try:
                kv_transfer.check_layout(self.runner.kv_caches, imported.kv, prompt_len)
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None

    def _check_fits(self, prompt_len: int, max_output_tokens: int, num_seqs: int) -> None:
        total = min(prompt_len + max_output_tokens, self.max_model_len)
        need = self.kv.worst_case_blocks(prompt_len, total, num_seqs)
        if need > self.kv.pool.num_blocks:
            raise RequestRejected(
                f"the request needs up to {need} KV blocks; the pool has {self.kv.pool.num_blocks}"
            )

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED):
        """End a request now and free its blocks; returns its final output (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason = reason
        return self._finish(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "kv_usage": pool.usage,
            "num_free_blocks": pool.num_free_blocks,
            "num_blocks": pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hits": pool.num_cache_hits,
            "prefix_cache_queries": pool.num_cache_queries,
            "num_kv_exports": self.updater.num_kv_exports,
            "num_kv_imports": self.num_kv_imports,
        }

    # -- the step -------------------------------------------------------------------------------

    def _expire(self, now: float) -> list[RequestOutput]:
        cfg, expired = self.config, []
        for request in list(self.requests.values()):
            last = request.last_token_time or request.arrival_time
            if (
                (request.deadline is not None and now >= request.deadline)
                or now - (request.e2e_start or request.arrival_time) >= cfg.e2e_timeout_s
                or now - last >= cfg.token_timeout_s
            ):
                expired.append(self.abort(request.request_id, FinishReason.TIMEOUT))
        return expired

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, update the requests with its logits."""
        start = time.monotonic()
        outputs = self._expire(start)
        batch = self.scheduler.schedule()
        outputs += [self._finish(request) for request in batch.ended]  # no model work to do
        self._write_imported_kv(batch.kv_writes)
        if batch.is_empty:
            return outputs
        sampled = batch.sampling_positions()
        logits = self._run(batch, sampled)
        updates = self.updater.update(batch, logits, sampled, start)
        for output in updates:
            if output.finished:
                self._forget(self.requests[output.request_id])
        return outputs + updates

    def _write_imported_kv(self, writes: list[KVWrite]) -> None:
        for write in writes:
            start = time.monotonic()
            self.runner.write_kv(write.block_table, write.payload)
            write.request.kv_import_ms = (time.monotonic() - start) * 1e3
            self.num_kv_imports += 1

    def _run(self, batch: ScheduledBatch, sampled: list[int]) -> torch.Tensor:
        """The forward pass; logits for the sequences at `sampled` positions of the batch."""
        self.runner.copy_blocks(self.kv.pending_copies)  # copy on write, before the writes
        self.kv.pending_copies.clear()
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens, sampled)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.kv.commit(seq)  # full blocks now serve later prompts' prefix matches
        return logits

    def _finish(self, request: Request, metrics: StepMetrics | None = None) -> RequestOutput:
        output = self.updater.finish(request, metrics or StepMetrics())
        self._forget(request)
        return output

    def _forget(self, request: Request) -> None:
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
