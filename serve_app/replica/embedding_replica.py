"""EmbeddingReplica: one embedding endpoint's encoder, answering `EmbedRequest`s.

A plain class: the app builder makes one Ray Serve deployment of it per `EmbeddingConfig[]`
item (`EmbeddingReplica`, or `EmbeddingReplica-<endpointName>` when there are several), and the
ingress calls `embed` through its handle. No tokenizer pool and no engine are involved: an
embedding is one forward pass of a small encoder, so the replica tokenizes, checks and embeds
by itself, on CPU.

Concurrent requests share forward passes: `embed` hands its request to a `MicroBatcher`, whose
worker thread runs everything waiting (up to `maxBatchSize` inputs) as one batch, while the
event loop keeps taking requests for the next one. A refused input (empty, over the model's
token limit) refuses its own request only, as a `Rejection` naming `input[i]`; errors travel
as values, never as exceptions, so every API family renders them in its own envelope.

Readiness: the ingress's `ready` waits for this deployment to be HEALTHY, which Ray Serve
reports once the constructor (the model load) has returned, so no method of its own is needed.
"""

from __future__ import annotations

import logging
import time

from serve_app.config import AppConfig
from serve_app.embedding import MicroBatcher
from serve_app.messages import EmbedRequest, EmbedResult, ErrorKind, Rejection
from serve_app.models.loader import resolve_model_path
from serve_app.placement import bind_process
from serve_app.replica.identity import replica_id

logger = logging.getLogger(__name__)


class EmbeddingReplica:
    """index: the EmbeddingConfig[] item served. off_engine_cores: bind this process to the
    cores no engine process is bound to (ModelConfig engineCpus), as the tokenizer pool does;
    the app builder asks for it, in-process users do not."""

    def __init__(self, config: AppConfig, index: int = 0, off_engine_cores: bool = False) -> None:
        if not 0 <= index < len(config.EmbeddingConfig):
            raise IndexError(f"EmbeddingConfig has no item {index}")
        entry = config.EmbeddingConfig[index]
        self.endpoint = entry.endpointName
        self.replica_id = replica_id()
        # print, not log: Ray forwards replica stdout to `serve run`, so users see the progress
        print(
            f"embedding replica {self.replica_id}: loading {entry.modelWeightPath!r} for "
            f"endpoint {self.endpoint!r} ...",
            flush=True,
        )
        start = time.monotonic()
        from serve_app.embedding.encoder import Encoder  # torch: here, not in the app's builder

        self.encoder = Encoder(resolve_model_path(entry.modelWeightPath), entry.maxBatchSize)
        self._batcher: MicroBatcher[EmbedRequest, EmbedResult | Rejection] = MicroBatcher(
            self._run, entry.maxBatchSize, size_of=lambda req: len(req.texts)
        )
        if off_engine_cores:  # loaded on every core (while the app starts), served on these
            bind_process(config.serving_cores())
        print(
            f"embedding replica {self.replica_id}: {self.endpoint!r} ready "
            f"({self.encoder.dimensions} dimensions, inputs up to "
            f"{self.encoder.max_input_tokens} tokens, {self.encoder.num_threads} torch threads) "
            f"in {time.monotonic() - start:.1f} s",
            flush=True,
        )

    async def embed(self, req: EmbedRequest) -> EmbedResult | Rejection:
        """One vector per text, in order, with token counts; or why the request is refused."""
        if not isinstance(req.texts, list) or not req.texts:
            return Rejection(req.param, f"{req.param} must be a non-empty list of texts")
        try:
            return await self._batcher.submit(req)
        except Exception as exc:  # the forward pass failed: a server error, still a value
            logger.exception("embedding replica %s: a batch failed", self.replica_id)
            message = f"embedding failed ({type(exc).__name__}); the replica's log has the details"
            return Rejection(req.param, message, ErrorKind.ENGINE)

    async def stats(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "endpoint": self.endpoint,
            "dimensions": self.encoder.dimensions,
            "max_input_tokens": self.encoder.max_input_tokens,
            "max_batch_size": self.encoder.max_batch_size,
            "num_batches": self._batcher.num_batches,
            "num_requests": self._batcher.num_items,
            "num_threads": self.encoder.num_threads,
        }

    def _run(self, requests: list[EmbedRequest]) -> list[EmbedResult | Rejection]:
        """On the batcher's worker thread: each request checked on its own, then every
        accepted input embedded in shared passes and handed back to its request."""
        from serve_app.embedding.encoder import InputRefused  # (loaded with the encoder)

        checked: list[list[list[int]] | Rejection] = []
        for req in requests:
            try:
                checked.append(self.encoder.tokenize(req.texts, req.param))
            except InputRefused as exc:
                checked.append(Rejection(exc.param, exc.message))
        accepted = [ids for one in checked if not isinstance(one, Rejection) for ids in one]
        vectors = iter(self.encoder.embed(accepted))
        return [
            one
            if isinstance(one, Rejection)
            else EmbedResult([next(vectors) for _ in one], [len(ids) for ids in one])
            for one in checked
        ]
