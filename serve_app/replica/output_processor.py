"""Engine outputs -> replica chunks, for one request: detokenize, apply stop strings, fold.

The engine reports token ids; every API family wants text. Each choice (sequence) gets its own
incremental detokenizer and stop matcher, fed one token at a time, so a stop string is found at
the exact token that completes it: the processor then marks that choice finished, and once every
choice is finished the replica leaves the engine stream, which aborts the engine request at that
step and frees its KV blocks. Nothing after a stop string is ever emitted.
A streamed request's `stream_interval` holds its chunks back (`stream_interval.ChunkHold`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.outputs import CompletionOutput, RequestOutput, StepMetrics, TokenLogprob
from serve_app.engine.params import FinishReason
from serve_app.messages import (
    ChoiceDelta,
    ErrorKind,
    ReplicaChunk,
    ReplicaRequest,
    StepInfo,
    TokenLogprobText,
)
from serve_app.replica.stream_interval import ChunkHold
from serve_app.tokenizer.detokenizer import IncrementalDetokenizer
from serve_app.tokenizer.stop import StopMatcher

logger = logging.getLogger(__name__)


def _step_info(m: StepMetrics) -> StepInfo:
    return StepInfo(m.batch_size, m.queue_wait_us, m.prefill_time_ms, m.decode_time_ms)


class _Choice:
    """The text state of one sequence of the request."""

    def __init__(self, index: int, req: ReplicaRequest, tokenizer: Any) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, req.prompt_token_ids, req.skip_special_tokens
        )
        self.stop = StopMatcher(req.stop, req.include_stop_str_in_output)
        self.include_stop = req.include_stop_str_in_output
        self.num_output_tokens = 0
        self.num_text_chars = 0  # characters of stop-processed text emitted so far
        self.finished = False

    def continue_after(self, first_token_id: int) -> None:
        """PD decode: the prefill replica already sent the first token (and its text, unless
        the detokenizer held it back). Replaying it through an identical detokenizer puts this
        one in the same state, so the next delta continues the text exactly, held bytes
        included."""
        self.detokenizer.push_one(first_token_id)
        self.num_output_tokens = 1
        self.num_text_chars = len(self.detokenizer.text)


class OutputProcessor:
    """Turns one request's `RequestOutput`s into `ReplicaChunk`s (stream) or one final chunk."""

    def __init__(
        self, req: ReplicaRequest, tokenizer: Any, first_token_id: int | None = None
    ) -> None:
        """first_token_id: PD decode, the output continues after this already-sent token."""
        self.req = req
        self._first_token_id = first_token_id
        self._tokenizer = tokenizer
        self._choices: dict[int, _Choice] = {}
        self._want_logprobs = req.params.logprobs is not None
        self._token_text_cache: dict[int, str] = {}
        # non-stream: everything folded into one final chunk
        self._folded: dict[int, ChoiceDelta] = {}
        self._steps: list[StepInfo] = []
        self.hold = ChunkHold(req.stream_interval)  # stream_interval: chunks held back

    @property
    def all_finished(self) -> bool:
        """Every choice the request returns has finished (engine finish or stop string)."""
        choices = self._choices
        if len(choices) < self.req.params.n:
            return False
        for choice in choices.values():  # a loop: called for every output of every stream
            if not choice.finished:
                return False
        return True

    def process(self, output: RequestOutput) -> ReplicaChunk | None:
        """The chunk to send for this engine output, or None when there is nothing to send yet.

        The returned chunk has `finished` set once the request is done: the engine finished it,
        or every choice ended on a stop string (the caller must then leave the engine stream).
        """
        deltas = []
        for co in output.outputs:
            choice = self._choice(co.index)
            if choice.finished:  # a stop string ended it; the engine may still be running it
                continue
            delta = self._consume(choice, co, finish_all=output.finished)
            if delta.token_ids or delta.text or delta.finish_reason:
                deltas.append(delta)
        steps = [_step_info(m) for m in self._step_metrics(output)]
        done = output.finished or self.all_finished
        if self.req.stream:
            if not deltas and not done:
                return None
            chunk = ReplicaChunk(self.req.request_id, choices=deltas, steps=steps)
        else:
            for delta in deltas:
                self._fold(delta)
            self._steps.extend(steps)
            if not done:
                return None
            choices = [self._folded[i] for i in sorted(self._folded)]
            chunk = ReplicaChunk(self.req.request_id, choices=choices, steps=self._steps)
        if done:
            self._finish_chunk(chunk)
        return self.hold.pass_on(chunk) if self.req.stream else chunk

    def process_first(self, output: RequestOutput, ends: bool) -> tuple[ReplicaChunk, bool]:
        """PD prefill: the chunk for the first token, and whether its text is held back.

        The engine finishes every prefill after one token. Unless that token really ends the
        request (`ends`: EOS, a stop token, an output limit of 1, maxSeqLen, an abort), the
        chunk is not final: no flush of a held-back incomplete character (the decode replica
        releases it with the next token), no finish reason. Always a delta, even for
        non-stream requests, so that the ingress can put the first token in front of decode's.
        """
        if ends:  # a finished output always makes a chunk, stream or not
            return self.process(output), False
        co = output.outputs[0]
        choice = self._choice(co.index)
        delta = self._consume(choice, replace(co, finish_reason=None, stop_reason=None), False)
        steps = [_step_info(m) for m in self._step_metrics(output)]
        chunk = ReplicaChunk(self.req.request_id, choices=[delta], steps=steps)
        chunk.num_prompt_tokens = len(self.req.prompt_token_ids)
        if self.all_finished:  # a stop string completed on the first token
            self._finish_chunk(chunk)
        return chunk, choice.detokenizer.has_pending

    @staticmethod
    def _step_metrics(output: RequestOutput) -> list[StepMetrics]:
        """The engine steps this output stands for: one per step that produced its tokens.

        A request the engine reports only at the end (beam search, best_of > n) carries every
        step's timing in `step_history`; a streamed output stands for its own step.
        """
        if output.step_history is not None:
            return output.step_history
        for co in output.outputs:
            if co.new_token_ids:
                return [output.metrics]
        return []

    def error_chunk(self, kind: ErrorKind, message: str) -> ReplicaChunk:
        """The final chunk of a request the engine refused or failed."""
        return ReplicaChunk(
            self.req.request_id,
            finished=True,
            num_prompt_tokens=len(self.req.prompt_token_ids),
            error=message,
            error_kind=kind,
        )

    def failure_chunk(self, exc: Exception) -> ReplicaChunk:
        """An engine failure as the request's final chunk: refused, failed, or a bug in the
        replica (which must not take the stream down silently)."""
        if isinstance(exc, RequestRejected):
            return self.error_chunk(ErrorKind.REJECTED, str(exc))
        if isinstance(exc, EngineError):
            return self.error_chunk(ErrorKind.ENGINE, str(exc))
        request_id = self.req.request_id
        logger.exception("request %s failed in the replica", request_id, exc_info=exc)
        message = f"the model replica failed; its log has the details (request {request_id})"
        return self.error_chunk(ErrorKind.ENGINE, message)

    # -- per choice -------------------------------------------------------------------------

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index, self.req, self._tokenizer)
            if self._first_token_id is not None:
                choice.continue_after(self._first_token_id)
        return choice

    def _consume(self, choice: _Choice, co: CompletionOutput, finish_all: bool) -> ChoiceDelta:
        delta = ChoiceDelta(
            index=choice.index,
            token_ids=[],
            text="",
            token_texts=[] if self.req.token_texts else None,
            logprobs=[] if self._want_logprobs else None,
            cumulative_logprob=co.cumulative_logprob,
        )
        texts: list[str] = []  # raw detokenizer delta per token (token_texts)
        base = len(co.token_ids) - len(co.new_token_ids)  # index of the first new token
        last = len(co.new_token_ids) - 1
        # The token that ended the choice (a stop token id, or EOS when special tokens are kept)
        # is not text the client asked for, unless include_stop_str_in_output (vLLM's rule).
        hide_stop_token = (
            co.finish_reason in (FinishReason.STOP_TOKEN, FinishReason.EOS)
            and not choice.include_stop
        )
        for j, token_id in enumerate(co.new_token_ids):
            raw = "" if j == last and hide_stop_token else choice.detokenizer.push_one(token_id)
            delta.token_ids.append(token_id)
            choice.num_output_tokens += 1
            texts.append(raw)
            if delta.logprobs is not None and co.logprobs and base + j < len(co.logprobs):
                delta.logprobs.append(self._logprob_text(co.logprobs[base + j]))
            if self._emit(choice, delta, raw, texts):
                break
        if not choice.finished and (co.finish_reason is not None or finish_all):
            tail = choice.detokenizer.flush()
            if texts:
                texts[-1] += tail
            if not self._emit(choice, delta, tail, texts):
                self._add_text(choice, delta, choice.stop.flush())
                reason = co.finish_reason or FinishReason.ABORTED
                choice.finished = True
                stop = co.stop_reason  # text in every family: a stop token is spelled out
                delta.finish_reason = reason.value
                delta.stop_reason = self._token_text(stop) if isinstance(stop, int) else stop
        delta.num_output_tokens = choice.num_output_tokens
        if delta.token_texts is not None:
            delta.token_texts = texts
        return delta

    def _emit(self, choice: _Choice, delta: ChoiceDelta, raw: str, texts: list[str]) -> bool:
        """Feeds raw text through the stop matcher; True when a stop string ended the choice."""
        safe, matched = choice.stop.push(raw)
        self._add_text(choice, delta, safe)
        if matched is None:
            return False
        # The token that completed the match may carry text past the stop string; its token
        # text is cut there too, so no field ever shows text beyond the stop string.
        stop_end = choice.num_text_chars + (0 if choice.include_stop else len(matched))
        excess = len(choice.detokenizer.text) - stop_end
        if excess > 0 and texts:
            texts[-1] = texts[-1][: max(0, len(texts[-1]) - excess)]
        choice.finished = True
        delta.finish_reason, delta.stop_reason = FinishReason.STOP_STRING.value, matched
        return True

    @staticmethod
    def _add_text(choice: _Choice, delta: ChoiceDelta, text: str) -> None:
        delta.text += text
        choice.num_text_chars += len(text)

    def _logprob_text(self, lp: TokenLogprob) -> TokenLogprobText:
        texts = self.req.logprob_texts
        return TokenLogprobText(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=self._token_text(lp.token_id) if texts else "",
            top=[(i, self._token_text(i) if texts else "", p) for i, p in lp.top],
        )

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._token_text_cache[token_id] = self._tokenizer.decode([token_id])
        return text

    # -- chunks -----------------------------------------------------------------------------

    def _fold(self, delta: ChoiceDelta) -> None:
        empty = ChoiceDelta(index=delta.index, token_ids=[], text="")
        self._folded.setdefault(delta.index, empty).absorb(delta)

    def _finish_chunk(self, chunk: ReplicaChunk) -> None:
        chunk.finished = True
        chunk.num_prompt_tokens = len(self.req.prompt_token_ids)
        if any(c.finish_reason == FinishReason.TIMEOUT.value for c in chunk.choices):
            chunk.error_kind = ErrorKind.TIMEOUT
            limit = self.req.timeout_s
            chunk.error = (
                f"request timed out after {limit:g} s (its timeout)"
                if limit is not None
                else "request timed out (the server's tokenTimeout or e2eTimeout)"
            )
