"""ModelReplica: one engine on one accelerator, streaming `ReplicaChunk`s for `ReplicaRequest`s.

A plain class: the app builder turns it into a Ray Serve deployment, and Ray Serve calls
`generate` with `handle.options(stream=True).generate.remote(req)`. Errors (a refused request, a
failed step, a timeout) end the stream with a final chunk that carries them; `generate` never
raises for them, so every API family can render them in its own envelope.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from serve_app.config import AppConfig, accelerator_env, load_config
from serve_app.engine.async_engine import (
    AsyncEngine,
    EngineError,
    GenerateRequest,
    RequestRejected,
)
from serve_app.messages import ReplicaChunk, ReplicaRequest
from serve_app.replica.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


class ModelReplica:
    def __init__(self, config: AppConfig | dict | None = None, model_index: int = 0) -> None:
        app_config = config if isinstance(config, AppConfig) else load_config(config)
        engine_config = app_config.engine_config(model_index)
        self.model_name = engine_config.model_name
        self.replica_id = uuid.uuid4().hex[:12]
        self.engine: AsyncEngine | None = None  # set last: __del__ may see a failed __init__
        # print, not log: Ray forwards replica stdout to `serve run`, so users see the progress
        print(f"model replica {self.replica_id}: loading {engine_config.model!r} ...", flush=True)
        start = time.monotonic()
        self.engine = AsyncEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        runner = self.engine.engine.runner
        print(
            f"model replica {self.replica_id}: {self.model_name!r} ready on {runner.device} "
            f"({runner.dtype}, {runner.num_blocks} KV blocks) in {time.monotonic() - start:.1f} s",
            flush=True,
        )

    async def generate(self, req: ReplicaRequest) -> AsyncIterator[ReplicaChunk]:
        """Chunks as the engine produces them (one final chunk when not streaming).

        The last chunk has `finished`, the prompt token count, the engine stats and, if the
        request failed, `error` and `error_kind`. Closing this generator early (client gone)
        aborts the engine request and frees its KV blocks.
        """
        # The deadline starts when the request reaches the replica, on this replica's clock.
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        request = GenerateRequest(
            req.request_id, list(req.prompt_token_ids), req.params, req.priority, deadline
        )
        processor = OutputProcessor(req, self.tokenizer)
        final: ReplicaChunk | None = None
        try:
            # aclosing: leaving the loop early (all choices hit a stop string) must abort the
            # engine request now, not whenever the engine's generator is garbage collected.
            async with aclosing(self.engine.generate(request)) as outputs:
                async for output in outputs:
                    chunk = processor.process(output)
                    if chunk is None:
                        continue
                    if chunk.finished:
                        final = chunk
                        break
                    yield chunk
        except RequestRejected as exc:
            final = processor.error_chunk("rejected", str(exc))
        except EngineError as exc:
            final = processor.error_chunk("engine", str(exc))
        except Exception as exc:  # a bug here must not take the replica's stream down silently
            logger.exception("request %s failed in the replica", req.request_id)
            final = processor.error_chunk("engine", f"replica error: {exc!r}")
        if final is None:
            final = processor.error_chunk("engine", "the engine ended the request without output")
        final.stats = self.engine.stats()
        final.replica_id = self.replica_id
        yield final

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def stats(self) -> dict:
        return {**self.engine.stats(), "replica_id": self.replica_id, "model": self.model_name}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died must be replaced."""
        thread = getattr(self.engine, "_thread", None)
        if self.engine is None or thread is None or not thread.is_alive():
            raise RuntimeError(f"replica {self.replica_id}: the engine loop thread is not running")

    async def device_info(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "model": self.model_name,
            "device": str(self.engine.engine.runner.device),
            "node_id": _ray_node_id(),
            **accelerator_env(),
        }

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to report to
            pass


def _ray_node_id() -> str | None:
    """The Ray node this replica runs on, when it runs under Ray (placement checks)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # not under Ray
        return None
