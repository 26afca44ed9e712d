"""Tokens per streamed chunk: a stream's chunks held back until each carries `stream_interval`
new tokens (the server's `streamInterval`, raised per request by the chat and completions
routes' `stream_interval`; vLLM's `--stream-interval`).

The first chunk goes at once, and so does the last. A request's final chunk that is an error
(its timeout) is not merged with what is held, since a stream renders no tokens from an error
chunk: the caller sends `take()` before it. Stop strings are unaffected: the output processor
still matches them token by token, before any chunk is held.
"""

from __future__ import annotations

from serve_app.messages import ReplicaChunk


class ChunkHold:
    """One streamed request's held chunk."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: ReplicaChunk | None = None
        self._sent_any = False

    def pass_on(self, chunk: ReplicaChunk) -> ReplicaChunk | None:
        """The chunk to send now, with what was held before it; None while it is held. A final
        chunk (`finished`) goes at once, with what was held unless it is an error."""
        if self.interval <= 1:  # never holds: each chunk brings a token, or ends the stream
            return chunk
        if self._held is not None and chunk.error is None:
            held, self._held = self._held, None
            held.absorb(chunk)
            chunk = held
        if not chunk.finished and self._sent_any and _new_tokens(chunk) < self.interval:
            self._held = chunk
            return None
        self._sent_any = True
        return chunk

    def take(self) -> ReplicaChunk | None:
        """What is held, now (nothing is held afterwards)."""
        held, self._held = self._held, None
        return held


def _new_tokens(chunk: ReplicaChunk) -> int:
    """The engine steps' worth of tokens in a chunk: its longest choice's new tokens."""
    return max((len(c.token_ids) for c in chunk.choices), default=0)
