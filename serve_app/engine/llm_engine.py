"""The engine loop: step() = expire deadlines -> schedule -> run the model -> update requests.

Synchronous and single-threaded; `LLM` drives it for offline batches and `AsyncEngine` runs it
on a thread of its own for serving. For prefill/decode disaggregation one engine runs a prompt
to its first token and exports the prompt's KV (a request with `export_kv`), and another
imports it and continues (a request with `imported`); see `kv_transfer`.
"""

from __future__ import annotations

import time

import torch

from serve_app.engine.backends.runner import ModelRunner
from serve_app.engine.block_pool import BlockPool
from serve_app.engine.config import EngineConfig
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.intake import Intake
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.outputs import RequestOutput, StepMetrics
from serve_app.engine.params import FinishReason
from serve_app.engine.sampler import Sampler
from serve_app.engine.scheduler import KVWrite, ScheduledBatch, Scheduler
from serve_app.engine.sequence import Request
from serve_app.engine.update import Updater
from serve_app.models.loader import tokenizer_eos_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, with_tokenizer: bool = True):
        """with_tokenizer=False: no tokenizer (`tokenizer` None); the end-of-sequence ids are
        then the model config's until the owner adds the tokenizer's (`eos_token_ids`)."""
        self.config = config  # checked when it was built
        self.runner = ModelRunner(config, with_tokenizer)
        self.tokenizer = self.runner.tokenizer
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(config.max_seq_len, hf.max_position_embeddings)
        pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(pool)
        self.scheduler = Scheduler(config, self.kv)
        device = self.runner.device
        sampler = Sampler(config.seed, device, self.runner.backend.argmax)
        self.updater = Updater(
            self.kv,
            sampler,
            self.runner.read_kv,
            self.max_model_len,
            self._eos_ids(),
            device,
            str(self.runner.model_path),
            self._logits_width(),
        )
        self.intake = Intake(
            config, self.vocab_size, self.max_model_len, self.kv, self.runner.kv_layout, device
        )
        self.requests: dict[str, Request] = {}
        self.num_kv_imports = 0
        self.num_steps = 0  # steps that ran the model (tests count progress by them)

    def _logits_width(self) -> int:
        """Entries in a logits row: the LM head's rows (may be padded past the tokenizer)."""
        head = self.runner.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        return int(weight.shape[0]) if weight is not None else self.vocab_size

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        generation = getattr(self.runner.model, "generation_config", None)
        for source in (self.runner.hf_config, generation):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        ids.update(tokenizer_eos_ids(self.tokenizer))
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
        `imported` (a PD decode): continue a request another engine prefilled, from its first
        token and, when given, its prompt's KV (else the prompt is recomputed here). The KV
        waits for room in the pool; like any request, the decode is recomputed only if pool
        pressure later takes its blocks (preemption).
        """
        tracked = self.intake(request, self.requests)
        self.updater.start_constraint(tracked)  # a grammar that cannot fit is refused here
        self.requests[tracked.request_id] = tracked
        imported = request.imported
        if imported is None:
            self.scheduler.add(tracked)
            return
        # A first token that ends it (EOS, a stop token, a cap of 1): the scheduler only reports it.
        self.updater.check_stop(tracked, tracked.seqs[0], imported.first_token_id)
        self.scheduler.add(tracked, imported.kv)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED):
        """End a request now and free its blocks; returns its final output (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason = reason
        return self._finish(request)

    def close(self) -> None:
        """Stop the other ranks of a model split over several (nothing to do on one)."""
        self.runner.close()

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
            "num_steps": self.num_steps,
            **self.runner.backend.stats(),  # e.g. the spare cores' share of the CPU kernels
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
        self.num_steps += 1
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
