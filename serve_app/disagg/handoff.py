"""The decode side of the KV hand-off: fetch the prompt's KV within the request's time, apply the
KV loss policy, and report the hand-off's cost once.

A KV that cannot be fetched (the prefill replica died, the object was lost, the connector's own
transfer timeout) is recomputed from the prompt on the decode replica, or fails the request under
kv_loss_policy "fail"; running out of the request's timeout during the fetch fails it as a
timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from serve_app.disagg.connector import KVConnector
from serve_app.engine.kv_transfer import KVPayload
from serve_app.messages import ErrorKind, KVTransfer, ReplicaChunk

logger = logging.getLogger(__name__)

KV_LOSS_POLICIES = ("recompute", "fail")


class HandoffFailed(Exception):
    """The request cannot continue on this decode replica; `kind` says why."""

    def __init__(self, kind: ErrorKind, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.lost = lost  # the KV could not be fetched (counted like a recomputed loss)


@dataclass(slots=True)
class Handoff:
    """A decode request's hand-off facts, reported once, on its first chunk."""

    fetch_ms: float
    kv_bytes: int
    recomputed: bool
    lost: bool = False  # the KV could not be fetched (then recomputed)
    import_ms: float = 0.0
    reported: bool = False

    def note_import(self, outputs: list) -> None:
        """The engine's KV import time, from whichever of its outputs reports it."""
        for output in outputs:
            if output.kv_import_ms is not None:
                self.import_ms = output.kv_import_ms

    def stamp(self, chunk: ReplicaChunk) -> None:
        if not self.reported:
            chunk.handoff_ms = self.fetch_ms + self.import_ms
            chunk.kv_bytes, chunk.kv_recomputed = self.kv_bytes, self.recomputed
            self.reported = True


async def fetch_kv(
    connector: KVConnector | None,
    transfer: KVTransfer | None,
    deadline: float | None,
    timeout_s: float | None,
    kv_loss_policy: str,
    request_id: str,
) -> tuple[KVPayload | None, Handoff]:
    """The staged KV (None: recompute the prompt here) and the hand-off's facts. Raises
    `HandoffFailed` when the request must end here instead."""
    start = time.monotonic()
    if transfer is None or connector is None:  # nothing staged: recompute the prompt here
        return None, Handoff(0.0, 0, recomputed=True)
    try:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        kv = await asyncio.wait_for(connector.fetch(transfer), remaining)
    except Exception as exc:  # ObjectLostError, OwnerDiedError, RayActorError, a timeout
        if deadline is not None and time.monotonic() >= deadline:  # the request's own time
            message = f"request timed out after {timeout_s:g} s (its timeout) in the KV hand-off"
            raise HandoffFailed(ErrorKind.TIMEOUT, message) from None
        if kv_loss_policy == "fail":
            logger.warning("KV of %s lost (%r): failing the request", request_id, exc)
            message = (
                "the prompt's KV cache could not be fetched from the prefill replica "
                f"({type(exc).__name__}); "
                "kv_loss_policy is 'fail', so it is not recomputed"
            )
            raise HandoffFailed(ErrorKind.ENGINE, message, lost=True) from None
        logger.warning("KV of %s lost (%r): recomputing the prompt", request_id, exc)
        elapsed = (time.monotonic() - start) * 1e3
        return None, Handoff(elapsed, 0, recomputed=True, lost=True)
    return kv, Handoff((time.monotonic() - start) * 1e3, transfer.nbytes, recomputed=False)
