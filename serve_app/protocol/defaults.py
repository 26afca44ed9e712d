"""What the API families' translations need from the server's config, built once per ingress.

A family's request model turns itself into a `TokenizeRequest` and a `ReplicaRequest`
(`tokenize_request`, `replica_request`); the values a request leaves out come from here, so that
every family fills them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.engine.params import DEFAULT_PRIORITY
from serve_app.tokenizer.limits import TokenLimits

# A MindIE or Triton request without `timeout` may run this long (MindIE's documented default).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ServerDefaults:
    limits: TokenLimits  # output caps (maxIterTimes) and the max_tokens default
    pd_mode: bool = False  # inferMode dmi: refuse what prefill/decode cannot run
    timeout_s: float = DEFAULT_TIMEOUT_S
    priority: int = DEFAULT_PRIORITY
    stream_interval: int = 1  # ServerConfig.streamInterval: a request may only raise it

    def priority_of(self, priority: int | None) -> int:
        return self.priority if priority is None else priority

    def timeout_of(self, timeout: float | None) -> float:
        return self.timeout_s if timeout is None else float(timeout)
