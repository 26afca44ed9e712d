"""Sampling parameters and finish reasons: what a request asks of the engine.

API layers translate their own request models into `SamplingParams`; only this small, picklable
object crosses deployment handles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from serve_app.engine.constraint import TokenConstraint

# Request priorities run from 1 (served first) to 5; a request that names none gets the lowest.
HIGHEST_PRIORITY, LOWEST_PRIORITY = 1, 5
DEFAULT_PRIORITY = LOWEST_PRIORITY


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; each API family maps these onto its own words."""

    EOS = "eos"  # the model's end-of-sequence token
    STOP_TOKEN = "stop_token"  # one of the request's stop_token_ids
    STOP_STRING = "stop_string"  # a stop string matched (set by the replica's stop matcher)
    LENGTH = "length"  # max_tokens, maxIterTimes or maxSeqLen reached
    ABORTED = "aborted"  # cancelled by the client or stopInfer
    TIMEOUT = "timeout"  # request timeout, tokenTimeout or e2eTimeout


def output_cap(max_iter_times: int, max_tokens: int | None) -> int:
    """Output tokens one request may generate: min(maxIterTimes, max_tokens), maxIterTimes when
    it names none (reaching maxSeqLen first also ends it)."""
    return max_iter_times if max_tokens is None else min(max_iter_times, max_tokens)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # defaults to n
    use_beam_search: bool = False
    temperature: float = 1.0  # 0 -> greedy
    do_sample: bool = True  # False -> greedy, whatever the temperature
    top_k: int = 0  # 0, -1 or >= vocab -> off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None -> maxIterTimes
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N alternatives to report besides the sampled token
    length_penalty: float = 1.0  # beam search score = cum_logprob / len ** length_penalty
    # structured output: a picklable spec each sequence starts its own grammar state from
    # (serve_app.structured builds them; engine/constraint.py is the protocol)
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.best_of < self.n:
            problems.append(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            problems.append(f"logprobs must be >= 0, got {self.logprobs}")
        if self.constraint is not None and self.use_beam_search:
            # beams re-rank forks every step; a grammar state per beam would have to follow
            problems.append("a constraint (structured output) cannot run with beam search")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or not self.do_sample

    @property
    def num_seqs(self) -> int:
        """How many sequences the request runs at once (beam width for beam search)."""
        return self.best_of
