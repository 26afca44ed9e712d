"""How the ingress reaches the tokenizer pool and the model replicas.

`RayBackend` calls Ray Serve deployment handles; `LocalBackend` calls the same plain classes in
process, so route tests need no Ray. Closing the iterator returned by `generate` (leaving it
early, a cancelled task) aborts the request in the replica, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.messages import (
    Rejection,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
)


class Backend(Protocol):
    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection: ...

    def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]: ...

    async def stats(self, model: str) -> dict: ...

    async def ready(self) -> bool: ...


class LocalBackend:
    """Plain TokenizerPool and ModelReplica objects in this process (tests, offline use)."""

    def __init__(self, tokenizer_pool: Any, replicas: dict[str, Any]) -> None:
        self.tokenizer_pool = tokenizer_pool
        self.replicas = replicas

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        return await self.tokenizer_pool.tokenize(req)

    def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        return self.replicas[model].generate(req)

    async def stats(self, model: str) -> dict:
        return await self.replicas[model].stats()

    async def ready(self) -> bool:
        return True


class RayBackend:
    """Ray Serve handles: one tokenizer pool, one model replica deployment per model name."""

    def __init__(self, tokenizer_pool: Any, replicas: dict[str, Any], app_name: str = "") -> None:
        self.tokenizer_pool = tokenizer_pool
        self.replicas = replicas
        self.app_name = app_name
        self.replica_deployments: list[str] = []  # names checked by ready(); set by the builder

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        return await self.tokenizer_pool.tokenize.remote(req)

    async def generate(self, model: str, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        stream = self.replicas[model].options(stream=True).generate.remote(req)
        done = False
        try:
            async for chunk in stream:
                done = chunk.finished
                yield chunk
        finally:
            if not done:  # left early (client gone, stopInfer, timeout): abort in the replica
                stream.cancel()

    async def stats(self, model: str) -> dict:
        return await self.replicas[model].stats.remote()

    async def ready(self) -> bool:
        """True once every model replica deployment is HEALTHY (all replicas loaded)."""
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
