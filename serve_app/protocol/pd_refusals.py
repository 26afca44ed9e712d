"""What prefill/decode disaggregation (inferMode dmi) cannot run, refused before any work.

A PD request runs one sequence whose first token comes from the prefill replica and the rest
from the decode replica, so nothing that needs several sequences, a look at the text across the
hand-off or per-token alternatives can be served. Every API family lists which of these its
request sets and calls `refuse_in_pd`; the first one given is named in the family's 4xx
(docs/apis.md#prefilldecode-infermode-dmi-rules). The PD token counts are `TokenLimits.pd_*`.
"""

from __future__ import annotations

from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError

PD_UNSUPPORTED = (
    "stop",
    "stop_words",  # Triton's TensorRT-LLM-style stop strings
    "include_stop_str_in_output",
    "n",
    "best_of",
    "use_beam_search",
    "logprobs",
    "top_logprobs",
)


def refuse_in_pd(pd_mode: bool, given: dict[str, bool]) -> None:
    """Raises for the first PD-unsupported parameter the request sets (given[param] True)."""
    if not pd_mode:
        return
    for param, is_given in given.items():
        if param not in PD_UNSUPPORTED:
            raise ValueError(f"{param!r} is not one of the PD-unsupported parameters")
        if is_given:
            raise APIError(
                ErrorKind.UNSUPPORTED,
                f"{param} is not supported in PD (inferMode dmi) mode",
                param,
            )
