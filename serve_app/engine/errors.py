"""The engine's errors, so that callers can tell a refused request from a failed one."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine could not take or finish a request."""


class RequestRejected(EngineError, ValueError):
    """`add_request` refused the request: input the engine can never serve (no step failed).

    A ValueError too: offline `LLM` users and tests that catch ValueError for bad input keep
    working, while servers can map it to a client error rather than an engine failure.
    """


class RankFailure(RuntimeError):
    """A collective among the ranks of a model split over several devices failed: another rank
    is gone or broke the group (engine/backends/parallel)."""

    def __init__(self, rank: int, world: int, cause: str) -> None:
        super().__init__(
            f"rank {rank} of a model split over worldSize {world} ranks: another rank is gone "
            f"or failed ({cause})"
        )
        self.world = world

    def client_message(self) -> str:
        return (
            f"a rank of the model (worldSize {self.world}) is gone or failed; the replica is "
            "being replaced"
        )
