"""Sequences and requests: the engine's bookkeeping for one generation stream.

One rule drives scheduling: a sequence's `num_computed_tokens` catches up with `num_tokens`.
A fresh prompt, a chunked prompt, a prefix-cache hit and a preempted sequence being recomputed
are all the same case; the step that makes them equal produces logits to sample from.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from serve_app.engine.constraint import ConstraintState
from serve_app.engine.outputs import CompletionOutput, RequestOutput, StepMetrics
from serve_app.engine.params import DEFAULT_PRIORITY, FinishReason, SamplingParams

_seq_ids = itertools.count()


def seeded_generator(seed: int | None, offset: int, device) -> torch.Generator | None:
    """A seeded request's own generator (None when unseeded). Sequence k of a request draws from
    seed + k, so that best_of forks sample apart yet reproducibly, whatever shares the batch."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + offset) % (1 << 64))
    return generator


@dataclass(slots=True, eq=False)
class Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    index: int = 0  # position among the request's sequences (the choice index)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[tuple] = field(default_factory=list)  # keys of the leading full blocks
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id, when one ended the sequence
    num_emitted: int = 0  # output tokens already reported (streaming cursor)
    # its own grammar state (structured output), started on first use; a fork starts a fresh
    # one, which catches up from the output it inherits
    constraint: ConstraintState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self) -> Sequence:
        """A copy sharing history; the caller shares the KV blocks (reference counts)."""
        generator = None
        if self.generator is not None:
            generator = torch.Generator(device=self.generator.device)
            generator.set_state(self.generator.get_state())
        return Sequence(
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            generator=generator,
            num_computed_tokens=self.num_computed_tokens,
            block_table=list(self.block_table),
            block_keys=list(self.block_keys),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs),
        )


class RequestStatus(enum.Enum):
    WAITING_FOR_KV = "waiting_for_kv"  # a PD decode until its imported KV is in the pool
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One client request: one sequence, or several (n / best_of / beam search) sharing a prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int  # min(maxIterTimes, max_tokens), the output limit before maxSeqLen
    # a PD prefill's cap for the whole generation (its own max_output_tokens is 1), so that a
    # grammar plans its output for the decode that continues it; None: max_output_tokens
    planned_output_tokens: int | None = None
    priority: int = DEFAULT_PRIORITY  # 1 highest .. 5 lowest
    arrival_time: float = field(default_factory=time.monotonic)
    # Start of the e2eTimeout window when the request began elsewhere (a PD decode continues a
    # prefill that already used part of it); None: the arrival here.
    e2e_start: float | None = None
    deadline: float | None = None  # monotonic time after which the request times out
    seqs: list[Sequence] = field(default_factory=list)  # live sequences
    finished_seqs: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    last_token_time: float | None = None  # when the latest token was emitted
    beam_hypotheses: list[tuple[float, Sequence]] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # set when the whole request ends early
    # timing of every step that produced tokens, kept only for requests that report once at the
    # end (beam search, best_of > n); streaming requests report each step as it happens
    step_history: list[StepMetrics] = field(default_factory=list)
    # prefill/decode disaggregation (see LLMEngine.add_request)
    export_kv: bool = False  # a prefill: export the prompt's KV when the first token is out
    kv_payload: object | None = None  # the exported KV, read before the blocks are freed
    generator_state: torch.Tensor | None = None
    kv_import_ms: float | None = None  # reported once, on the first output after an import

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def output_plan(self) -> int:
        """The output limit a constraint plans for (see planned_output_tokens)."""
        return self.planned_output_tokens or self.max_output_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def to_output(
        self, seqs: list[Sequence], metrics: StepMetrics, new_only: bool, partial: bool = False
    ) -> RequestOutput:
        """What the API layers see; new_only reports only tokens not reported before.

        partial: a streamed output before the last, whose token_ids and logprobs hold only its
        new tokens' (what a stream consumes); copying every token so far into each step's
        output made the engine process's per-step message grow with every token.
        """
        completions = []
        want_logprobs = self.params.logprobs is not None
        for seq in sorted(seqs, key=lambda s: s.index):
            emitted = seq.num_emitted if new_only else 0
            start = seq.num_prompt_tokens + emitted
            new = seq.token_ids[start:]
            tokens = new if partial else seq.output_token_ids
            seq.num_emitted = seq.num_output_tokens
            logprobs = None
            if want_logprobs:
                logprobs = seq.logprobs[emitted:] if partial else list(seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=tokens,
                    new_token_ids=new,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        output = RequestOutput(self.request_id, self.prompt_token_ids, completions, metrics=metrics)
        output.kv_import_ms, self.kv_import_ms = self.kv_import_ms, None
        return output
