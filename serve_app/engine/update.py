"""The update stage of a step: the forward pass's logits in, new tokens and outputs out.

A request moves on only when every one of its sequences reached its sampling point this step.
Then each sequence gets one token (best_of forks split off at the first token; beam search
re-ranks its beams instead), the token is appended, and whatever ends the sequence (EOS, a stop
token, the output cap, maxSeqLen) is checked. Requests that stream report their new tokens every
step; beam search and best_of > n report once, at the end, with the timing of every step. A PD
prefill's KV is read here, before its blocks go back to the pool. A sequence with a constraint
(structured output) gets its grammar state here, and the sampler lets it mask its row.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from serve_app.engine import beam_search
from serve_app.engine.constraint import ConstraintContext, ConstraintState, remaining_tokens
from serve_app.engine.errors import RequestRejected
from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.kv_transfer import KVPayload
from serve_app.engine.outputs import RequestOutput, StepMetrics, TokenLogprob
from serve_app.engine.params import FinishReason
from serve_app.engine.sampler import Sampler, SampleRow
from serve_app.engine.scheduler import ScheduledBatch
from serve_app.engine.sequence import Request, RequestStatus, Sequence, seeded_generator

ReadKV = Callable[[list[int], int], KVPayload]  # block table, tokens -> the KV on the host


class Updater:
    """The update stage; its finish() also ends requests aborted or timed out between steps."""

    def __init__(
        self,
        kv: KVCacheManager,
        sampler: Sampler,
        read_kv: ReadKV,
        max_model_len: int,
        eos_token_ids: set[int],
        device: torch.device,
        model_path: str = "",
        vocab_size: int = 0,
    ):
        self.kv = kv
        self.sampler = sampler
        self.read_kv = read_kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = device  # where best_of forks keep their generators
        self.model_path = model_path  # for constraints: the tokenizer's folder
        self.vocab_size = vocab_size  # for constraints: the width of a logits row
        self.num_kv_exports = 0

    def update(
        self, batch: ScheduledBatch, logits: torch.Tensor, sampled: list[int], start: float
    ) -> list[RequestOutput]:
        """Advance the batch's requests by one token; logits row k is batch.seqs[sampled[k]]'s.

        start: when the step began (queue wait of the tokens it produced).
        """
        row_of = {batch.seqs[i].seq_id: row for row, i in enumerate(sampled)}
        # A preempted group of forks is recomputed one sequence at a time: it moves on together.
        ready = [r for r in batch.requests if all(s.seq_id in row_of for s in r.seqs)]
        plain = [r for r in ready if not r.params.use_beam_search]
        beams = [r for r in ready if r.params.use_beam_search]
        self._sample(plain, logits, row_of)
        for request in beams:
            self._beam_step(request, logits, row_of)
        now = time.monotonic()
        outputs = [self._report(request, len(batch.seqs), start, now) for request in plain + beams]
        return [output for output in outputs if output is not None]

    def _sample(self, requests: list[Request], logits: torch.Tensor, row_of: dict) -> None:
        rows: list[SampleRow] = []
        logit_rows: list[int] = []
        owners: list[tuple[Request, Sequence]] = []
        for request in requests:
            self._fork_for_best_of(request)
            for seq in request.seqs:
                row = SampleRow(
                    request.params, request.prompt_token_ids, seq.output_token_ids, seq.generator
                )
                if request.params.constraint is not None:
                    row.constraint = self._constraint_state(request, seq)
                    row.remaining = self._remaining(request, seq)
                rows.append(row)
                # a fork made just now samples from its parent's row
                logit_rows.append(row_of.get(seq.seq_id, row_of.get(request.seqs[0].seq_id)))
                owners.append((request, seq))
        if not rows:
            return
        params = [r.params for r in rows]
        num_top = max((p.logprobs or 0) for p in params)
        # best_of > n ranks its runs by cumulative log-probability, asked for or not
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
            seq.token_ids.append(result.token_ids[k])
            self.check_stop(request, seq, result.token_ids[k])

    def _fork_for_best_of(self, request: Request) -> None:
        """At the first sampled token, one prefilled sequence becomes best_of sequences."""
        params, seq = request.params, request.seqs[0]
        if params.best_of > 1 and len(request.seqs) == 1 and seq.num_output_tokens == 0:
            for index in range(1, params.best_of):
                child = self.kv.fork(seq)
                child.index = index
                child.generator = seeded_generator(params.seed, index, self.device)
                request.seqs.append(child)

    # -- constraints (structured output) --------------------------------------------------------

    @property
    def constraint_context(self) -> ConstraintContext:
        return ConstraintContext(
            self.model_path, self.vocab_size, tuple(sorted(self.eos_token_ids))
        )

    def start_constraint(self, request: Request) -> None:
        """At intake: start the first sequence's grammar state, and refuse (RequestRejected)
        a constraint that cannot start or whose shortest output exceeds the output limit."""
        if request.params.constraint is None:
            return
        try:
            state = self._constraint_state(request, request.seqs[0])
        except (ImportError, ValueError, RuntimeError) as exc:  # no xgrammar, a bad schema
            raise RequestRejected(f"the output constraint cannot start: {exc}") from None
        room = self._remaining(request, request.seqs[0]) + request.seqs[0].num_output_tokens
        if state.min_output_tokens > room:
            raise RequestRejected(
                f"the output limit ({room} tokens: max_tokens, maxIterTimes or maxSeqLen) is "
                f"below the {state.min_output_tokens} tokens of the shortest output the "
                "constraint (response format) allows"
            )

    def _constraint_state(self, request: Request, seq: Sequence) -> ConstraintState:
        if seq.constraint is None:
            seq.constraint = request.params.constraint.start(self.constraint_context)
        return seq.constraint

    def _remaining(self, request: Request, seq: Sequence) -> int:
        return remaining_tokens(
            request.output_plan, seq.num_output_tokens, self.max_model_len, seq.num_tokens
        )

    def _beam_step(self, request: Request, logits: torch.Tensor, row_of: dict) -> None:
        index = torch.tensor([row_of[s.seq_id] for s in request.seqs], device=logits.device)
        logprobs = torch.log_softmax(logits[index].float(), dim=-1)
        request.seqs = beam_search.beam_step(request, logprobs, self.kv, self.eos_token_ids)
        for seq in request.seqs:  # EOS endings became hypotheses; the cap ends live beams
            if self.at_length_limit(request, seq):
                seq.finish_reason = FinishReason.LENGTH

    def check_stop(self, request: Request, seq: Sequence, token: int) -> None:
        """Whether the token just appended ends the sequence, and why."""
        params = request.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = FinishReason.EOS
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP_TOKEN, token
        elif self.at_length_limit(request, seq):
            seq.finish_reason = FinishReason.LENGTH

    def at_length_limit(self, request: Request, seq: Sequence) -> bool:
        """max_output_tokens outputs, or prompt + output = maxSeqLen."""
        return (
            seq.num_output_tokens >= request.max_output_tokens
            or seq.num_tokens >= self.max_model_len
        )

    def _report(
        self, request: Request, batch_size: int, start: float, now: float
    ) -> RequestOutput | None:
        """The request's output for this step: its new tokens, its final output, or nothing
        (a request that reports only at the end, not there yet)."""
        metrics = step_metrics(request, batch_size, start, now)
        request.last_token_time = now
        if not streams(request):  # one final output: it reports every step's timing
            request.step_history.append(metrics)
        if self._done(request):
            return self.finish(request, metrics)
        if streams(request):
            seqs = request.seqs + request.finished_seqs
            return request.to_output(seqs, metrics, new_only=True, partial=True)
        return None

    def _done(self, request: Request) -> bool:
        """Whether the request is over; finished sequences give their blocks back now."""
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
        request.kv_payload = self.read_kv(seq.block_table, seq.num_prompt_tokens)
        request.kv_payload.read_ms = (time.monotonic() - start) * 1e3
        self.num_kv_exports += 1

    def finish(self, request: Request, metrics: StepMetrics) -> RequestOutput:
        """End the request (done, aborted or timed out): free its blocks, pick the sequences it
        returns and build its final output. Forgetting it is the caller's part."""
        params = request.params
        for seq in request.seqs:  # live sequences end with the request, for its reason
            seq.finish_reason = seq.finish_reason or request.finish_reason
        if params.use_beam_search:
            seqs = beam_search.finish(request, request.seqs, self.kv)
        else:
            for seq in request.seqs:
                self.kv.free(seq)
            seqs = request.finished_seqs + request.seqs
            if params.best_of > params.n:  # the n most likely of the best_of runs
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
                for index, seq in enumerate(seqs):
                    seq.index = index
        request.seqs = []
        request.status = RequestStatus.FINISHED
        output = request.to_output(seqs, metrics, new_only=streams(request))
        output.finished = True
        output.kv_payload, output.generator_state = request.kv_payload, request.generator_state
        if not streams(request):
            output.step_history = list(request.step_history)
        return output


def streams(request: Request) -> bool:
    """Token-by-token output only when every sequence run is also returned."""
    p = request.params
    return not p.use_beam_search and p.best_of == p.n


def step_metrics(request: Request, batch_size: int, start: float, now: float) -> StepMetrics:
    """Timing of the token(s) a step produced: since arrival for the first, since the previous
    token for later ones."""
    metrics = StepMetrics(batch_size=batch_size, num_preemptions=request.num_preemptions)
    if request.last_token_time is None:
        metrics.prefill_time_ms = (now - request.arrival_time) * 1e3
        metrics.queue_wait_us = (request.first_scheduled_time - request.arrival_time) * 1e6
    else:
        metrics.decode_time_ms = (now - request.last_token_time) * 1e3
        metrics.queue_wait_us = max(0.0, start - request.last_token_time) * 1e6
    return metrics
