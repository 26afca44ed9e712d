"""Health, readiness, model listing, metrics and stopInfer (MindIE management + OpenAI models)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Depends, Response
from pydantic import Field

from serve_app.ingress.metrics import CONTENT_TYPE
from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.messages import ErrorKind
from serve_app.protocol.errors import APIError
from serve_app.protocol.fields import RequestModel

router = APIRouter()
_STATS_TIMEOUT_S = 2.0


@router.get("/health", tags=["health"])
async def health() -> dict:
    return {"status": "healthy"}


@router.get("/v2/health/live", tags=["health"])
async def live() -> dict:
    return {"live": True}


@router.get("/v2/health/ready", tags=["health"])
async def ready(p: Pipeline = Depends(pipeline_of)) -> dict:
    if not await p.backend.ready():
        raise APIError(ErrorKind.UNAVAILABLE, "the model replicas are still loading")
    return {"ready": True}


@router.get("/v2/models/{model}/ready", tags=["health"])
async def model_ready(model: str, p: Pipeline = Depends(pipeline_of)) -> dict:
    p.check_model(model)
    if not await p.backend.ready():
        raise APIError(ErrorKind.UNAVAILABLE, f"model {model!r} is still loading")
    return {"ready": True}


@router.get("/v1/models", tags=["openai"])
async def list_models(p: Pipeline = Depends(pipeline_of)) -> dict:
    return {"object": "list", "data": [_model_card(p, name) for name in p.model_names]}


@router.get("/v1/models/{model}", tags=["openai"])
async def get_model(model: str, p: Pipeline = Depends(pipeline_of)) -> dict:
    return _model_card(p, p.check_model(model))


def _model_card(p: Pipeline, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": p.created,
        "owned_by": "serve_app",
        "max_model_len": p.defaults.limits.max_seq_len,
    }


@router.get("/v2", tags=["triton"])
async def server_metadata(p: Pipeline = Depends(pipeline_of)) -> dict:
    return {
        "name": "serve_app",
        "version": "0.1.0",
        "extensions": {"max_iter_times": p.defaults.limits.max_iter_times, "generate": True},
    }


@router.get("/v2/models/{model}", tags=["triton"])
async def model_metadata(model: str, p: Pipeline = Depends(pipeline_of)) -> dict:
    return {"name": p.check_model(model), "versions": ["1"], "platform": "serve_app"}


@router.get("/metrics", tags=["health"])
async def metrics(p: Pipeline = Depends(pipeline_of)) -> Response:
    running = None  # the replicas running now (Ray's actor list), where known
    with contextlib.suppress(Exception):
        running = await p.backend.running()
    for model in p.model_names:  # fresh engine gauges; a busy or loading replica is skipped
        with contextlib.suppress(Exception):
            for stats in await asyncio.wait_for(p.backend.stats(model, running), _STATS_TIMEOUT_S):
                p.metrics.update_stats(model, stats)
    if running is not None:  # replicas that left stop counting
        p.metrics.forget_departed(set().union(*running.values()))
    return Response(p.metrics.render(), media_type=CONTENT_TYPE)


class StopInferRequest(RequestModel):
    id: str = Field(description="The `id` a running generate request was sent with (any string).")


@router.post("/v2/models/{model}/stopInfer", tags=["mindie"])
async def stop_infer(
    model: str, body: StopInferRequest, p: Pipeline = Depends(pipeline_of)
) -> dict:
    """Stops a running request by the `id` it was sent with; its KV blocks are freed."""
    p.check_model(model)
    if not await p.stop(body.id):
        raise APIError(ErrorKind.NOT_FOUND, f"no running request has id {body.id!r}", "id")
    return {"id": body.id}
