"""The engine loop: step() = expire deadlines -> schedule -> run the model -> sample -> report.

Synchronous and single-threaded; `LLM` drives it for offline batches and `AsyncEngine` runs it
on a thread of its own for serving. For prefill/decode disaggregation one engine runs a prompt
to its first token and exports the prompt's KV (a request with `export_kv`), and another
imports it and continues (a request with `imported`); see `kv_transfer`.
"""

from __future__ import annotations

import time

import torch

from serve_app.engine import beam_search, kv_transfer
from serve_app.engine.block_pool import BlockPool
from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.model_runner import ModelRunner
from serve_app.engine.outputs import RequestOutput, StepMetrics, TokenLogprob
from serve_app.engine.params import FinishReason
from serve_app.engine.sampler import Sampler, SampleRow
from serve_app.engine.scheduler import KVWrite, ScheduledBatch, Scheduler
from serve_app.engine.sequence import Request, RequestStatus, Sequence, seeded_generator


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.check()
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        hf = self.runner.hf_config
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(config.max_seq_len, hf.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        pool = BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(pool)
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(config.seed, self.runner.device)
        self.requests: dict[str, Request] = {}
        self.num_kv_imports = 0
        self.num_kv_exports = 0

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        generation = getattr(self.runner.model, "generation_config", None)
        for source in (self.runner.hf_config, generation):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

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
        self._check_stop(tracked, seq, imported.first_token_id)
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
        return self._finish(request, StepMetrics())

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
            "num_kv_exports": self.num_kv_exports,
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
        start = time.monotonic()
        outputs = self._expire(start)
        batch = self.scheduler.schedule()
        outputs += [self._finish(request, StepMetrics()) for request in batch.ended]
        self._write_imported_kv(batch.kv_writes)
        if batch.is_empty:
            return outputs
        self.runner.copy_blocks(self.kv.pending_copies)
        self.kv.pending_copies.clear()
        sample = [
            i
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
            if seq.num_computed_tokens + n == seq.num_tokens
        ]
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens, sample)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.kv.commit(seq)
        row_of = {batch.seqs[i].seq_id: row for row, i in enumerate(sample)}
        ready = [r for r in batch.requests if all(s.seq_id in row_of for s in r.seqs)]
        outputs.extend(self._sample_and_report(batch, ready, logits, row_of, start))
        return outputs

    def _write_imported_kv(self, writes: list[KVWrite]) -> None:
        for write in writes:
            start = time.monotonic()
            self.runner.write_kv(write.block_table, write.payload)
            write.request.kv_import_ms = (time.monotonic() - start) * 1e3
            self.num_kv_imports += 1

    def _sample_and_report(
        self,
        batch: ScheduledBatch,
        ready: list[Request],
        logits: torch.Tensor,
        row_of: dict,
        start: float,
    ):
        rows: list[SampleRow] = []
        logit_rows: list[int] = []
        owners: list[tuple[Request, Sequence]] = []
        beams: list[Request] = []
        for request in ready:
            if request.params.use_beam_search:
                beams.append(request)
                continue
            self._fork_for_best_of(request)
            for seq in request.seqs:
                rows.append(
                    SampleRow(
                        request.params,
                        request.prompt_token_ids,
                        seq.output_token_ids,
                        seq.generator,
                    )
                )
                logit_rows.append(row_of.get(seq.seq_id, row_of.get(request.seqs[0].seq_id)))
                owners.append((request, seq))
        sampled = {}
        if rows:
            params = [r.params for r in rows]
            num_top = max((p.logprobs or 0) for p in params)
            need = any(p.logprobs is not None or p.best_of > p.n for p in params)
            picked = logits
            if logit_rows != list(range(logits.shape[0])):  # forks or beams: pick rows
                picked = logits[logit_rows]
            result = self.sampler(picked, rows, num_top=num_top, need_logprobs=need)
            for k, (request, seq) in enumerate(owners):
                if result.chosen_logprobs is not None:
                    logprob = result.chosen_logprobs[k]
                    seq.cumulative_logprob += logprob
                    if request.params.logprobs is not None:
                        top = result.top[k][: request.params.logprobs] if result.top else []
                        seq.logprobs.append(TokenLogprob(result.token_ids[k], logprob, top))
                self._append(request, seq, result.token_ids[k])
                sampled[request.request_id] = request
        for request in beams:
            index = torch.tensor([row_of[s.seq_id] for s in request.seqs], device=logits.device)
            logprobs = torch.log_softmax(logits[index].float(), dim=-1)
            request.seqs = beam_search.beam_step(request, logprobs, self.kv, self.eos_token_ids)
            for seq in request.seqs:
                if self._at_length_limit(request, seq):
                    seq.finish_reason = FinishReason.LENGTH
            sampled[request.request_id] = request
        now = time.monotonic()
        outputs = []
        for request in sampled.values():
            metrics = self._metrics(request, batch, start, now)
            request.last_token_time = now
            if not self._streams(request):  # one final output: it reports every step's timing
                request.step_history.append(metrics)
            if self._request_done(request):
                outputs.append(self._finish(request, metrics))
            elif self._streams(request):
                outputs.append(
                    request.to_output(request.seqs + request.finished_seqs, metrics, new_only=True)
                )
        return outputs

    def _fork_for_best_of(self, request: Request) -> None:
        """At the first sampled token, one prefilled sequence becomes best_of sequences."""
        params, seq = request.params, request.seqs[0]
        if params.best_of > 1 and len(request.seqs) == 1 and seq.num_output_tokens == 0:
            for index in range(1, params.best_of):
                child = self.kv.fork(seq)
                child.index = index
                child.generator = seeded_generator(params.seed, index, self.runner.device)
                request.seqs.append(child)

    def _append(self, request: Request, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        self._check_stop(request, seq, token)

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        params = request.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = FinishReason.EOS
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP_TOKEN, token
        elif self._at_length_limit(request, seq):
            seq.finish_reason = FinishReason.LENGTH

    def _at_length_limit(self, request: Request, seq: Sequence) -> bool:
        """min(maxIterTimes, max_tokens) outputs, or prompt + output = maxSeqLen."""
        return (
            seq.num_output_tokens >= request.max_output_tokens
            or seq.num_tokens >= self.max_model_len
        )

    def _request_done(self, request: Request) -> bool:
        if request.params.use_beam_search:
            live = [s for s in request.seqs if s.finish_reason is None]
            return len(live) < len(request.seqs) or beam_search.is_done(request, live)
        for seq in [s for s in request.seqs if s.finish_reason is not None]:
            if request.export_kv:
                self._export(request, seq)
            self.kv.free(seq)
            request.seqs.remove(seq)
            request.finished_seqs.append(seq)
        return not request.seqs

    def _export(self, request: Request, seq: Sequence) -> None:
        """Read the prompt's KV before its blocks go back (the first token has no KV yet)."""
        if seq.generator is not None:
            request.generator_state = seq.generator.get_state()
        if seq.finish_reason in (FinishReason.EOS, FinishReason.STOP_TOKEN):
            return  # the request ends here: nobody will continue it
        start = time.monotonic()
        request.kv_payload = self.runner.read_kv(seq.block_table, seq.num_prompt_tokens)
        request.kv_payload.read_ms = (time.monotonic() - start) * 1e3
        self.num_kv_exports += 1

    @staticmethod
    def _streams(request: Request) -> bool:
        """Token-by-token output only when every sequence run is also returned."""
        p = request.params
        return not p.use_beam_search and p.best_of == p.n

    def _metrics(self, request: Request, batch: ScheduledBatch, start: float, now: float):
        metrics = StepMetrics(batch_size=len(batch.seqs), num_preemptions=request.num_preemptions)
        if request.last_token_time is None:
            metrics.prefill_time_ms = (now - request.arrival_time) * 1e3
            metrics.queue_wait_us = (request.first_scheduled_time - request.arrival_time) * 1e6
        else:
            metrics.decode_time_ms = (now - request.last_token_time) * 1e3
            metrics.queue_wait_us = max(0.0, start - request.last_token_time) * 1e6
        return metrics

    def _finish(self, request: Request, metrics: StepMetrics) -> RequestOutput:
        params = request.params
        if params.use_beam_search:
            for seq in request.seqs:
                seq.finish_reason = seq.finish_reason or request.finish_reason
            seqs = beam_search.finish(request, request.seqs, self.kv)
            request.seqs = []
        else:
            for seq in request.seqs:
                seq.finish_reason = seq.finish_reason or request.finish_reason
                self.kv.free(seq)
            seqs = request.finished_seqs + request.seqs
            request.seqs = []
            if params.best_of > params.n:  # the n most likely of the best_of runs
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
                for index, seq in enumerate(seqs):
                    seq.index = index
        for seq in seqs:
            seq.finish_reason = seq.finish_reason or request.finish_reason
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request.request_id, None)
        output = request.to_output(seqs, metrics, new_only=self._streams(request))
        output.finished = True
        output.kv_payload, output.generator_state = request.kv_payload, request.generator_state
        if not self._streams(request):
            output.step_history = list(request.step_history)
        return output
