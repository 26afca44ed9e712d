"""How the ingress reaches the tokenizer pool, the model replicas and the embedding replicas.

`RayBackend` calls Ray Serve deployment handles; `LocalBackend` calls the same plain classes in
process, so route tests need no Ray. Closing the iterator returned by `generate` (leaving it
early, a cancelled task) aborts the request in the replica, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from serve_app.ingress.availability import Availability
from serve_app.ingress.replica_stats import serve_replicas, stats_of_replicas
from serve_app.messages import (
    DecodeRequest,
    EmbedRequest,
    EmbedResult,
    ErrorKind,
    PrefillResult,
    Rejection,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.token_socket.inbox import TokenInbox
from serve_app.tokenizer.limits import TokenLimits, token_ids_prompt

logger = logging.getLogger(__name__)


class Backend(Protocol):
    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection: ...

    def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]: ...

    # inferMode dmi: the prompt on a prefill replica, the rest on a decode replica
    async def prefill(self, model: str, req: ReplicaRequest) -> PrefillResult: ...

    def decode(self, model: str, req: DecodeRequest) -> AsyncIterator[ReplicaChunk]: ...

    async def stats(self, model: str, running: dict | None = None) -> list[dict]: ...  # by role

    async def running(self) -> dict[str, set[str]] | None: ...  # Ray's replicas; None: unknown

    async def embed(self, endpoint: str, req: EmbedRequest) -> EmbedResult | Rejection: ...

    async def ready(self) -> bool: ...

    async def unavailable(self, model: str) -> str | None: ...  # why no replica of it can now

    # stopInfer across ingress replicas (ingress/stops.py); without a shared registry: no-ops
    def watch_stop(self, key: str, event: asyncio.Event) -> Callable[[], None] | None:
        """Sets `event` when another ingress replica is asked to stop `key`; returns the call
        that ends the watch (None: nothing to end)."""
        ...

    async def stop_elsewhere(self, key: str) -> bool: ...


class _Targets:
    """The tokenizer pool, each model's replicas by role, each embedding endpoint's."""

    def __init__(
        self,
        tokenizer_pool: Any,
        replicas: dict[str, Any],
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        embedding: dict[str, Any] | None = None,
        stop_registry: Any = None,
    ) -> None:
        """stop_registry: the StopRegistry shared by several ingress replicas (or None)."""
        self.tokenizer_pool = tokenizer_pool
        self.replicas = replicas  # colocated (inferMode standard)
        self.prefill_replicas = prefill or {}
        self.decode_replicas = decode or {}
        self.embedding_replicas = embedding or {}
        self.stop_registry = stop_registry
        self.availability: Availability | None = None  # per model (Ray: set by the builder)

    async def unavailable(self, model: str) -> str | None:
        return await self.availability.unavailable(model) if self.availability else None

    async def running(self) -> dict[str, set[str]] | None:
        return None  # in process: no replica comes or goes

    def replicas_of(self, model: str) -> list:
        groups = (self.replicas, self.prefill_replicas, self.decode_replicas)
        return [group[model] for group in groups if model in group]

    def watch_stop(self, key: str, event: asyncio.Event) -> Callable[[], None] | None:
        if self.stop_registry is None:
            return None
        held, cancel = self._hold(key)

        async def relay() -> None:
            with contextlib.suppress(Exception):  # Ray Serve cancels the hold with its request
                if await held:
                    event.set()

        task = asyncio.ensure_future(relay())

        def unwatch() -> None:
            task.cancel()
            cancel()  # the registry forgets the id

        return unwatch

    def _hold(self, key: str) -> tuple[Any, Callable[[], None]]:
        """The shared registry's `hold(key)` call: (an awaitable, the call that cancels it)."""
        raise NotImplementedError


class LocalBackend(_Targets):
    """Plain TokenizerPool, ModelReplica and EmbeddingReplica objects in process (tests)."""

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        return await self.tokenizer_pool.tokenize(req)

    def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        return self.replicas[model].generate(req)

    async def prefill(self, model: str, req: ReplicaRequest) -> PrefillResult:
        return await self.prefill_replicas[model].prefill(req)

    def decode(self, model: str, req: DecodeRequest) -> AsyncIterator[ReplicaChunk]:
        return self.decode_replicas[model].decode(req)

    async def stats(self, model: str, running: dict | None = None) -> list[dict]:
        return [await replica.stats() for replica in self.replicas_of(model)]

    async def embed(self, endpoint: str, req: EmbedRequest) -> EmbedResult | Rejection:
        return await self.embedding_replicas[endpoint].embed(req)

    async def ready(self) -> bool:
        return True

    def _hold(self, key: str) -> tuple[Any, Callable[[], None]]:
        task = asyncio.ensure_future(self.stop_registry.hold(key))
        return task, task.cancel

    async def stop_elsewhere(self, key: str) -> bool:
        return self.stop_registry is not None and self.stop_registry.stop(key)


class RayBackend(_Targets):
    """Ray Serve handles: one tokenizer pool, replica deployments per model name and role, an
    embedding deployment per embedding endpoint."""

    def __init__(
        self,
        tokenizer_pool: Any,
        replicas: dict[str, Any],
        app_name: str = "",
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        embedding: dict[str, Any] | None = None,
        stop_registry: Any = None,
        token_inbox: TokenInbox | None = None,
    ) -> None:
        """token_inbox: the ingress's token socket, for the chunks of replicas on its node
        (None: each chunk is a Ray message of its own)."""
        super().__init__(tokenizer_pool, replicas, prefill, decode, embedding, stop_registry)
        self.app_name = app_name
        self.replica_deployments: list[str] = []  # names checked by ready(); set by the builder
        self.token_inbox = token_inbox
        self._limits: dict[str, TokenLimits] = {}  # per model, once the pool said
        self._asking: dict[str, asyncio.Future] = {}
        self._streaming: dict[tuple[str, str], Any] = {}  # (method, model) -> its handle

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        """A pool replica that died under the call is retried once on another, then the request
        is refused as unavailable (503). A prompt of token ids needs only its model's limits:
        known from the pool (one call per model), it is checked here by the pool's function."""
        from ray.exceptions import RayActorError

        if req.kind == "token_ids" and not req.counting:
            limits = self._limits.get(req.model) or await self._learn_limits(req.model)
            if limits is not None:
                return token_ids_prompt(limits, req)
        try:
            return await self.tokenizer_pool.tokenize.remote(req)
        except RayActorError:
            pass
        try:
            return await self.tokenizer_pool.tokenize.remote(req)
        except RayActorError:
            message = "no tokenizer pool replica is available now; retry later"
            return Rejection(None, message, ErrorKind.UNAVAILABLE)

    async def _learn_limits(self, model: str) -> TokenLimits | None:
        """`model`'s token limits from the pool (one call at a time per model); None when the
        pool cannot say now (then the pool checks the prompt, and is asked again next time)."""
        asking = self._asking.get(model)
        if asking is None:
            asking = self._asking[model] = asyncio.ensure_future(self._ask_limits(model))
        try:
            limits = await asyncio.shield(asking)
        finally:
            if asking.done() and self._asking.get(model) is asking:
                del self._asking[model]
        if limits is not None:
            self._limits[model] = limits
        return limits

    async def _ask_limits(self, model: str) -> TokenLimits | None:
        try:
            return await self.tokenizer_pool.limits.remote(model)
        except Exception as exc:  # no pool replica now, a model the pool does not serve
            logger.debug("token limits of %r not known yet: %s", model, exc)
            return None

    def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        method = self._streaming_method("generate", model)
        if self.token_inbox is not None:
            return self.token_inbox.stream(req, lambda: method.remote(req))
        return _stream(method.remote(req))

    async def prefill(self, model: str, req: ReplicaRequest) -> PrefillResult:
        response = self.prefill_replicas[model].prefill.remote(req)
        try:
            return await response
        except asyncio.CancelledError:
            # awaiting a DeploymentResponse does not cancel it with its caller (stopInfer,
            # timeout, client gone): the prefill replica aborts it and frees its blocks now
            response.cancel()
            raise

    def decode(self, model: str, req: DecodeRequest) -> AsyncIterator[ReplicaChunk]:
        method = self._streaming_method("decode", model)
        if self.token_inbox is not None:
            return self.token_inbox.stream(req.request, lambda: method.remote(req))
        return _stream(method.remote(req))

    def _streaming_method(self, name: str, model: str) -> Any:
        """The streaming handle of `name` ("generate": colocated, "decode") for `model`, made
        once: `options()` and each method lookup build a new handle, on every request."""
        method = self._streaming.get((name, model))
        if method is None:
            handles = self.replicas if name == "generate" else self.decode_replicas
            method = getattr(handles[model].options(stream=True), name)
            self._streaming[(name, model)] = method
        return method

    async def stats(self, model: str, running: dict | None = None) -> list[dict]:
        return await stats_of_replicas(self.replicas_of(model), running)

    async def running(self) -> dict[str, set[str]] | None:
        return await asyncio.to_thread(serve_replicas)

    async def embed(self, endpoint: str, req: EmbedRequest) -> EmbedResult | Rejection:
        response = self.embedding_replicas[endpoint].embed.remote(req)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()  # the client went away: leave the replica's next batch too
            raise

    def _hold(self, key: str) -> tuple[Any, Callable[[], None]]:
        response = self.stop_registry.hold.remote(key)
        return response, response.cancel

    async def stop_elsewhere(self, key: str) -> bool:
        if self.stop_registry is None:
            return False
        return await self.stop_registry.stop_held.remote(key)

    async def ready(self) -> bool:
        """True once every model and embedding replica deployment is HEALTHY (all loaded)."""
        from ray import serve

        try:
            status = await asyncio.to_thread(serve.status)
        except Exception:  # the controller is unreachable: not ready
            return False
        app = status.applications.get(self.app_name)
        if app is None:
            return False
        for name in self.replica_deployments:
            deployment = app.deployments.get(name)
            if deployment is None or str(deployment.status).split(".")[-1] != "HEALTHY":
                return False
        return True


async def _stream(stream) -> AsyncIterator[ReplicaChunk]:
    """A Serve streaming response; leaving early cancels the request in the replica."""
    done = False
    try:
        async for chunk in stream:
            done = chunk.finished
            yield chunk
    finally:
        if not done:  # left early (client gone, stopInfer, timeout): abort in the replica
            stream.cancel()
