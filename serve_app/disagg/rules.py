"""The documented PD (inferMode dmi) rules, in one place (DESIGN.md "Token-count rules",
MINDIE.md "PD").

- Prefill produces exactly the first token; decode produces the rest; `generated_tokens` and
  `completion_tokens` count both (the replicas' `num_output_tokens` includes the first token).
- When the output limit comes from maxIterTimes (max_tokens absent or not smaller), decode runs
  maxIterTimes steps itself, so the total is maxIterTimes + 1; a smaller max_tokens is exact.
- stop, include_stop_str_in_output, n, best_of, use_beam_search, logprobs and top_logprobs are
  refused before any work, with the family's 4xx naming the parameter.
- Input-length rules are the colocated ones (the tokenizer pool applies them unchanged).
"""

from __future__ import annotations

from serve_app.protocol.errors import APIError
from serve_app.tokenizer.limits import TokenLimits

UNSUPPORTED = (
    "stop",
    "include_stop_str_in_output",
    "n",
    "best_of",
    "use_beam_search",
    "logprobs",
    "top_logprobs",
)


def refuse_unsupported(pd_mode: bool, given: dict[str, bool]) -> None:
    """Raises for the first PD-unsupported parameter the request sets (given[param] True)."""
    if not pd_mode:
        return
    for param, is_given in given.items():
        if is_given:
            if param not in UNSUPPORTED:
                raise ValueError(f"{param!r} is not one of the PD-unsupported parameters")
            raise APIError(
                "unsupported",
                f"{param} is not supported in PD (inferMode dmi) mode",
                param,
            )


def total_output_limit(limits: TokenLimits, max_tokens: int | None) -> int:
    """Output tokens of a PD request, the prefill's first token included."""
    return limits.pd_total_tokens(max_tokens)


def decode_steps(limits: TokenLimits, max_tokens: int | None) -> int:
    """Tokens the decode replica generates after the prefill's first one."""
    return limits.pd_decode_tokens(max_tokens)
