"""One sequence's grammar state: masks its logits so that its output is the grammar's, and ends
that output within the sequence's token budget.

The promise kept: the closing policy (closing.py) can always complete the output within the
tokens that remain. Far from the end of the budget the mask is just the grammar's, the cheap
case (docs/performance.md, "Masks and the closing policy"), and every `MEASURE_EVERY` output
tokens the state measures the policy's path from there. Once the remaining tokens come within
`WINDOW` of that measure (or of `MAX_MEASURE`, whichever is larger), it plans every step:

* when the path needs as many tokens as remain, the policy's token is forced, and the next step
  finds the same path one token shorter, down to the last allowed token;
* otherwise the sampler may pick among the grammar's best tokens (by logit, up to
  `CANDIDATES`) those after which the path still fits, and the policy's own token, which always
  does. Checking each candidate is what makes the promise hold: one token can open far more
  than it closes (`[{"` in an array of objects with required keys).

Outside the window (more than MAX_MEASURE + WINDOW tokens left) the promise rests on no single
token adding more than that many tokens to the path. Within it the sampler only draws from the
best few allowed tokens: the price of checking each one.

Every decision is a function of the output so far, the remaining tokens and the logits (the
measures are taken at fixed output lengths), so a fresh state that catches up from the output
(a best_of fork, a PD decode) masks exactly as the state that saw it token by token.

Once the output is complete, the grammar allows only the engine's EOS ids, so the sequence ends
with EOS. Tokens the matcher refuses (output produced without this state) leave it broken: it
then allows only EOS, ending the sequence rather than the engine step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from serve_app.engine.constraint import ConstraintContext
from serve_app.structured.closing import ClosingPolicy, fill_mask
from serve_app.structured.json_lexer import JsonLexer

log = logging.getLogger(__name__)

WINDOW = 64  # remaining tokens beyond the closing path's length from which each step plans
MEASURE_EVERY = 8  # output tokens between measures of the closing path
MAX_MEASURE = 256  # a measure stops there (a longer path: the window starts 256 + WINDOW out)
CANDIDATES = 8  # most tokens checked per step within the window, best logits first
CHECK_STEPS = 192  # ...and fewer when the path is long: about this many policy steps in all
MAX_PLAN = 1024  # longest closing path looked for from the start (else: not guaranteed)
_FEW_BANNED = 10_000  # below this many banned tokens xgrammar's CPU kernel is the faster


class JsonState:
    def __init__(self, grammar, policy: ClosingPolicy, ctx: ConstraintContext):
        import xgrammar as xgr

        stop = list(ctx.eos_token_ids) or None  # the engine's EOS ends a complete output
        self.matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop)
        self.bitmask = xgr.allocate_token_bitmask(1, ctx.vocab_size)
        self.policy = policy
        self.lexer = JsonLexer()  # where the accepted text stands (for the closing policy)
        self.vocab_size = ctx.vocab_size
        self.eos = list(ctx.eos_token_ids)
        self.num_accepted = 0  # output tokens the matcher has taken
        self.broken = False
        # the policy's path from the current state, when known (kept while the output follows it)
        self._plan = policy.path(self.matcher, self.lexer, self.bitmask, MAX_PLAN)
        self._min = len(self._plan) if self._plan is not None else 0
        self._measured = min(self._min, MAX_MEASURE)  # the path's length at the latest measure

    @property
    def min_output_tokens(self) -> int:
        """The closing policy's length from the start: the shortest output this state can
        promise to complete (0 when the policy cannot finish this grammar)."""
        return self._min

    def mask(self, logits_row: torch.Tensor, output_ids: Sequence[int], remaining: int) -> None:
        self._catch_up(output_ids)
        if self.broken or self.matcher.is_terminated():
            self._keep(logits_row, self.eos)
            return
        if remaining > max(self._measured, MAX_MEASURE) + WINDOW:
            self._apply_grammar(logits_row)
            return
        path = self._closing_path(min(remaining, MAX_PLAN))
        if path is None or len(path) >= remaining:  # hand over to the policy
            token = path[0] if path else self._policy_token()
            self._keep(logits_row, [token] if token is not None else self.eos)
            return
        # Within the window every step checks its candidates: one token (a "," before a new
        # object with many required keys) can lengthen the path by more than the window.
        self._apply_grammar(logits_row)
        self._keep(logits_row, self._safe_candidates(logits_row, remaining - 1, path))

    def _catch_up(self, output_ids: Sequence[int]) -> None:
        """Accept the output tokens not seen yet (a fork's history, a PD prefill's token)."""
        for token in output_ids[self.num_accepted :]:
            self.num_accepted += 1
            if self.broken:
                continue
            if not self.matcher.accept_token(token):
                log.warning("token %d does not follow the grammar: only EOS from here", token)
                self.broken = True
                continue
            self.lexer.feed(self.policy.vocab.token_bytes[token])
            if self._plan and self._plan[0] == token:
                self._plan = self._plan[1:]  # the path from the new state: the same, shorter
            else:
                self._plan = None
            if self.num_accepted % MEASURE_EVERY == 0:
                path = self._closing_path(MAX_MEASURE)
                self._measured = len(path) if path is not None else MAX_MEASURE

    def _closing_path(self, limit: int) -> list[int] | None:
        """The closing policy's path from here when it takes at most `limit` tokens."""
        if self._plan is None:
            self._plan = self.policy.path(self.matcher, self.lexer, self.bitmask, limit)
        return self._plan if self._plan is not None and len(self._plan) <= limit else None

    def _safe_candidates(self, row: torch.Tensor, budget: int, path: list[int]) -> list[int]:
        """The policy's token and the best-scoring allowed tokens after which the closing path
        takes at most `budget` tokens."""
        count = max(2, min(CANDIDATES, CHECK_STEPS // (len(path) + 1)))
        values, tokens = row.topk(min(count, row.shape[-1]))
        # a complete value (path []) may still go on (a number's next digit): EOS always fits
        safe = [path[0]] if path else list(self.eos)
        for value, token in zip(values.tolist(), tokens.tolist(), strict=True):
            if value == float("-inf"):
                break
            if token in safe:
                continue
            sim, lexer = self.matcher.fork(), self.lexer.copy()
            if not sim.accept_token(token):
                continue
            lexer.feed(self.policy.vocab.token_bytes[token])
            if self.policy.path(sim, lexer, self.bitmask, budget) is not None:
                safe.append(token)
        return safe

    def _policy_token(self) -> int | None:
        return self.policy.next_token(self.matcher, self.lexer, self.bitmask)

    def _apply_grammar(self, row: torch.Tensor) -> None:
        fill_mask(self.matcher, self.bitmask, self.policy.vocab)
        self._apply(row)

    def _keep(self, row: torch.Tensor, tokens: list[int]) -> None:
        """Only `tokens` stay possible, with their own logits (a kept -inf becomes 0). On CPU
        through numpy: no torch thread pool to wake for a 0.6 MB fill."""
        if row.device.type == "cpu":
            values = row.numpy()
            kept = np.nan_to_num(values[tokens], nan=0.0, neginf=0.0)
            values.fill(-np.inf)
            values[tokens] = kept
            return
        index = torch.tensor(tokens, device=row.device)
        kept = row[index].nan_to_num(nan=0.0, neginf=0.0)
        row.fill_(float("-inf"))
        row[index] = kept

    def _apply(self, row: torch.Tensor) -> None:
        """-inf wherever the bitmask has a 0. xgrammar's CPU kernel costs in proportion to the
        tokens it bans (little inside a string, which bans few; far more on a wide row that
        allows few), one masked copy the same whatever the mask: each where it is cheaper, the
        two meeting at _FEW_BANNED (docs/performance.md, "Masks and the closing policy")."""
        import xgrammar as xgr

        words = self.bitmask.numpy()[0]
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        on_cpu = row.device.type == "cpu"
        if on_cpu and self.vocab_size - np.count_nonzero(allowed) < _FEW_BANNED:
            xgr.apply_token_bitmask_inplace(row, self.bitmask[0], vocab_size=self.vocab_size)
            return
        banned = ~allowed.view(np.bool_)
        if on_cpu:
            np.copyto(row.numpy()[: self.vocab_size], -np.inf, where=banned)
        else:
            banned = torch.from_numpy(banned).to(row.device, non_blocking=True)
            row[: self.vocab_size].masked_fill_(banned, float("-inf"))
