"""One request's way through the graph, shared by every API family.

`Pipeline.translate` has a family's request check itself, asks the tokenizer pool for prompt ids
(a rejection becomes an `APIError`) and builds the `ReplicaRequest` with the server's defaults;
`Pipeline.generate` iterates the model replica's chunks while watching three ways to end early:
the request's own `timeout`, a stopInfer for its id, and the client going away (the task is
cancelled), without a task of their own (`interruptible.py`). Leaving early
closes the replica stream, which aborts the request there and frees its KV blocks.
`Pipeline.embed` sends texts to an embedding endpoint's replica. Metrics are observed here, once
for every family.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request

from serve_app.config import AppConfig
from serve_app.disagg.flow import pd_generate
from serve_app.ingress import fan_out, request_ids
from serve_app.ingress.backend import Backend
from serve_app.ingress.interruptible import END, INTERRUPTED, Interruptible
from serve_app.ingress.metrics import Metrics
from serve_app.ingress.stops import StopRegistry
from serve_app.messages import (
    ChoiceDelta,
    EmbedRequest,
    EmbedResult,
    ErrorKind,
    Rejection,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError
from serve_app.tokenizer.limits import TokenLimits

# The ingress's own timer is a backstop behind the engine's deadline for the same timeout, so
# that a request stuck before the engine (queued at a busy replica) still ends.
_BACKSTOP_S = 1.0
_ids = itertools.count(1)
logger = logging.getLogger(__name__)


class FamilyRequest(Protocol):
    """What every API family's request model does to translate itself (protocol/)."""

    def check(self, pd_mode: bool) -> None: ...

    def tokenize_request(self, model: str) -> TokenizeRequest: ...

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest: ...  # a family may take more, keyword-only (Triton: the route's stream)


async def pipeline_of(request: Request) -> Pipeline:
    """FastAPI dependency: the app's pipeline (async: FastAPI runs a plain function's
    dependency in a worker thread, a thread hop per request)."""
    return request.app.state.pipeline


class Pipeline:
    def __init__(self, config: AppConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.model_names = config.model_names
        self.default_model = self.model_names[0]
        self.embedding_names = config.embedding_names
        # Model-independent limits for the protocol layer (output caps and defaults); the
        # tokenizer pool applies the full rules with each model's max_position_embeddings.
        self.defaults = ServerDefaults(
            TokenLimits.of(config),
            config.pd_mode,
            stream_interval=config.ServerConfig.streamInterval,
        )
        self.keepalive_s = config.ServerConfig.streamKeepAlive  # sse.peek's
        self.stops = StopRegistry()
        self.metrics = Metrics()
        self.created = int(time.time())

    # -- helpers for the routes -------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The served model for a request's `model` (None: the first one)."""
        if name is None:
            return self.default_model
        if name not in self.model_names:
            raise APIError(
                ErrorKind.NOT_FOUND,
                f"model {name!r} is not served here; served models: {', '.join(self.model_names)}",
                "model",
            )
        return name

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{next(_ids)}-{uuid.uuid4().hex[:8]}"

    async def stop(self, key: str) -> bool:
        """stopInfer: the request with this id, on this ingress replica or another."""
        return self.stops.stop(key) or await self.backend.stop_elsewhere(key)

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt:
        result = await self.backend.tokenize(req)
        if isinstance(result, Rejection):
            raise APIError.of(result)
        return result

    async def translate(
        self, body: FamilyRequest, model: str, id_prefix: str, **route: Any
    ) -> tuple[ReplicaRequest, TokenizedPrompt]:
        """A family's request as the replica request it becomes: its own checks (PD refusals
        first), the prompt from the tokenizer pool, then the server's defaults filled in."""
        body.check(self.defaults.pd_mode)
        prompt = await self.tokenize(body.tokenize_request(model))
        request_id = self.new_request_id(id_prefix)
        return body.replica_request(request_id, prompt, self.defaults, **route), prompt

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self, model: str, req: ReplicaRequest, stop_key: str | None = None
    ) -> AsyncIterator[ReplicaChunk]:
        """The replica's chunks. Errors raise `APIError`; a stopInfer ends the stream with a
        final chunk whose unfinished choices have finish_reason "aborted"."""
        if (down := await self.backend.unavailable(model)) is not None:  # at once, not queued
            raise APIError(ErrorKind.UNAVAILABLE, down)
        # the server's streamInterval, unless the request asked for more
        req.stream_interval = max(req.stream_interval, self.defaults.stream_interval)
        stop_event = self.stops.register(stop_key) if stop_key is not None else asyncio.Event()
        # other ingress replicas' stopInfer calls reach this request through the shared registry
        unwatch = self.backend.watch_stop(stop_key, stop_event) if stop_key is not None else None
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + req.timeout_s + _BACKSTOP_S if req.timeout_s else None
        if self.defaults.pd_mode:
            upstream = pd_generate(self.backend, model, req, self.defaults.limits)
        else:
            upstream = self.backend.generate(model, req)
        self.metrics.received.labels(model).inc()
        first_token_at, num_tokens, num_prompt = None, 0, 0
        outcome, num_chunks = "failed", 0
        chunks = Interruptible(upstream, deadline)
        # One waiter for the whole request: it stays pending across chunks until a stopInfer.
        stopped = asyncio.ensure_future(stop_event.wait())
        stopped.add_done_callback(chunks.interrupt)
        try:
            while True:
                chunk = await chunks.next()
                if chunk is END:
                    return
                if chunk is INTERRUPTED:
                    if stop_event.is_set():
                        outcome = "success"
                        yield _stopped_chunk(req)
                        return
                    raise APIError(
                        ErrorKind.TIMEOUT,
                        f"Engine callback timeout: the request did not finish within its "
                        f"timeout of {req.timeout_s:g} s",
                        "timeout",
                    )
                if chunk.error is not None:
                    self.metrics.update_stats(model, chunk.stats)
                    error = APIError(chunk.error_kind or ErrorKind.ENGINE, chunk.error)
                    error.partial = chunk
                    raise error
                if self.defaults.pd_mode and num_chunks < 2:
                    observe = (self.metrics.observe_prefill, self.metrics.observe_first_decode)
                    observe[num_chunks](model, chunk)
                num_chunks += 1
                new = sum(len(c.token_ids) for c in chunk.choices)
                if new and first_token_at is None:
                    first_token_at = loop.time() - _since_first_token(chunk)
                num_tokens += new
                num_prompt = chunk.num_prompt_tokens or num_prompt
                if chunk.finished:
                    outcome = "success"
                    self.metrics.update_stats(model, chunk.stats)
                yield chunk
                if chunk.finished:
                    return
        finally:
            stopped.cancel()
            if stop_key is not None:
                self.stops.unregister(stop_key, stop_event)
            if unwatch is not None:
                unwatch()
            # a wait still in progress (the client went away, a stop, the timeout) is
            # cancelled and the replica stream closed: the replica aborts the request
            await chunks.close()
            end = loop.time()
            self.metrics.observe_request(
                model, outcome, start, end, first_token_at, num_prompt, num_tokens
            )
            # the one line that ties the client's X-Request-ID (Ray Serve puts it on every line
            # of the request; request_ids.current() outside Serve) to the engine's request id
            logger.info(
                "request %s: engine request %s, model %s, %s, %d prompt + %d output tokens, "
                "%.3f s", request_ids.current(), req.request_id, model, outcome, num_prompt,
                num_tokens, end - start,
            )  # fmt: skip

    async def collect(
        self,
        model: str,
        req: ReplicaRequest,
        stop_key: str | None = None,
        partial_on_timeout: bool = False,
    ) -> ReplicaChunk:
        """Non-stream: every chunk folded into one (text, ids, logprobs and steps concatenated).
        partial_on_timeout: a timeout returns what was generated (`finished` False, the timed-out
        choices without a finish reason)."""
        merged = ReplicaChunk(request_id=req.request_id)
        try:
            async for chunk in self.generate(model, req, stop_key):
                merged.absorb(chunk)
        except APIError as exc:
            if not (partial_on_timeout and exc.kind == ErrorKind.TIMEOUT):
                raise
            if exc.partial is not None:
                merged.absorb(exc.partial.cut_short())
        return merged

    async def collect_many(
        self, model: str, reqs: list[ReplicaRequest], partial_on_timeout: bool = False
    ) -> list[ReplicaChunk]:
        """Several requests of one call, each folded as `collect` folds it, in order."""
        return await fan_out.gather_all(
            self.collect(model, r, None, partial_on_timeout) for r in reqs
        )

    def generate_many(
        self, model: str, reqs: list[ReplicaRequest], truncate: bool = False
    ) -> AsyncIterator[tuple[int | None, ReplicaChunk | None]]:
        """Several requests' streams as one: (index, chunk) as they come, (index, None) where
        `truncate` ended one at its timeout, (None, None) at the end (fan_out.merged)."""
        return fan_out.merged(
            [fan_out.until_timeout(self.generate(model, r), truncate) for r in reqs]
        )

    # -- embeddings -------------------------------------------------------------------------

    async def embed(self, endpoint: str, req: EmbedRequest) -> EmbedResult:
        """The endpoint's vectors for req.texts, in order. APIError: an unknown endpoint (404,
        naming the served ones), an input refused by the replica (400 naming `input[i]`), a
        failed forward pass (500)."""
        if endpoint not in self.embedding_names:
            served = ", ".join(self.embedding_names) or "none (EmbeddingConfig is empty)"
            raise APIError(
                ErrorKind.NOT_FOUND,
                f"embedding endpoint {endpoint!r} is not served here; served embedding "
                f"endpoints: {served}",
                "model",
            )
        m, start = self.metrics, time.monotonic()
        m.received.labels(endpoint).inc()
        try:
            result = await self.backend.embed(endpoint, req)
        except BaseException:  # the replica died, the client went away
            m.failed.labels(endpoint).inc()
            raise
        if isinstance(result, Rejection):
            m.failed.labels(endpoint).inc()
            raise APIError.of(result)
        num_tokens = sum(result.num_tokens)
        m.success.labels(endpoint).inc()
        m.prompt_tokens.labels(endpoint).inc(num_tokens)
        m.request_prompt_tokens.labels(endpoint).observe(num_tokens)
        m.e2e.labels(endpoint).observe(time.monotonic() - start)
        return result


def _since_first_token(chunk: ReplicaChunk) -> float:
    """Seconds from the first token in `chunk` to its last: the engine steps folded into it after
    its first (a non-stream response carries all of them; a stream, the tokens that came while
    its consumer was behind). The time to first token is the chunk's arrival less this."""
    return sum(step.decode_time_ms or 0.0 for step in chunk.steps[1:]) / 1e3


def _stopped_chunk(req: ReplicaRequest) -> ReplicaChunk:
    """The end of a request stopped by stopInfer: every choice finishes as "aborted"."""
    n = req.params.n
    choices = [
        ChoiceDelta(index=i, token_ids=[], text="", finish_reason="aborted") for i in range(n)
    ]
    return ReplicaChunk(request_id=req.request_id, choices=choices, finished=True)
