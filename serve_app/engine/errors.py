"""The engine's errors, so that callers can tell a refused request from a failed one."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not take or finish a request."""


class RequestRejected(EngineError, ValueError):
    """`add_request` refused the request: input the engine can never serve (no step failed).

    A ValueError too: offline `LLM` users and tests that catch ValueError for bad input keep
    working, while servers can map it to a client error rather than an engine failure.
    """
