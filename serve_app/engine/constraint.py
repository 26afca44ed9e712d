"""The constraint hook: how structured output (a grammar) restricts the tokens a sequence samples.

A request carries a `TokenConstraint` in its `SamplingParams`: a small picklable spec (it crosses
Ray handles and the engine process's pipe), never live state. The engine starts one
`ConstraintState` per sequence from it, so n > 1 and best_of forks each follow the grammar on
their own, and hands the state each step the sequence's output so far: a state that has not
seen some of those tokens (a fresh one after a fork, a PD decode continuing a prefill's first
token) accepts them first. The grammar itself lives outside the engine (`serve_app.structured`);
the engine knows only this protocol, and requests without a constraint never reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ConstraintContext:
    """What a grammar needs to know about the engine that runs it."""

    model_path: str  # the model folder, whose tokenizer spells the tokens
    vocab_size: int  # width of a logits row (the LM head's; may exceed the tokenizer's)
    eos_token_ids: tuple[int, ...]  # the ids that end a sequence once the output is complete


class ConstraintState(Protocol):
    """One sequence's grammar state."""

    @property
    def min_output_tokens(self) -> int:
        """Tokens the shortest output this state can guarantee needs from its start (0: not
        known). The engine refuses a request whose output limit is smaller."""
        ...

    def mask(self, logits_row: torch.Tensor, output_ids: Sequence[int], remaining: int) -> None:
        """Set the disallowed entries of this sequence's logits row to -inf, in place.

        output_ids: the sequence's output so far (the state accepts those it has not seen).
        remaining: how many more tokens the sequence may produce, this one included, before
        its output limit (max_tokens / maxIterTimes, or maxSeqLen) ends it: a state that must
        finish its output in time closes it within that many tokens.
        """
        ...


class TokenConstraint(Protocol):
    """The picklable spec a request carries; `start` runs in the engine, once per sequence."""

    def start(self, ctx: ConstraintContext) -> ConstraintState: ...


def remaining_tokens(cap: int, num_output_tokens: int, max_model_len: int, num_tokens: int) -> int:
    """Tokens a sequence may still produce, the next one included: the same limits that end it
    with LENGTH (its output cap, and maxSeqLen for prompt + output)."""
    return min(cap - num_output_tokens, max_model_len - num_tokens)
