"""Triton's generate extension: `/v2/models/{model}[/versions/{version}]/generate` and
`.../generate_stream`.

Errors before generation are Triton's {"error": msg} (400 validation, 404 unknown model or
version); generate_stream peeks the first chunk so those stay HTTP errors, and an error after
the 200 is one SSE event {"error": msg}. A request with an `id` is registered for
`POST /v2/models/{model}/stopInfer {"id"}` (admin_routes), which ends it with finish_reason
stop_sequence and frees its KV blocks (docs/apis.md#triton-generate).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from serve_app.ingress import sse
from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.messages import ErrorKind
from serve_app.protocol import triton
from serve_app.protocol.errors import APIError

router = APIRouter(tags=["triton"])
MODEL_VERSIONS = ("1",)  # one version per served model (GET /v2/models/{model} says the same)


@router.post("/v2/models/{model}/generate", summary="Generate (Triton extension)")
async def generate(model: str, body: triton.GenerateRequest, p: Pipeline = Depends(pipeline_of)):
    return await _generate(p, model, None, body, stream=False)


@router.post("/v2/models/{model}/versions/{version}/generate", summary="Generate, one version")
async def generate_version(
    model: str, version: str, body: triton.GenerateRequest, p: Pipeline = Depends(pipeline_of)
):
    return await _generate(p, model, version, body, stream=False)


@router.post("/v2/models/{model}/generate_stream", summary="Generate as SSE")
async def generate_stream(
    model: str, body: triton.GenerateRequest, p: Pipeline = Depends(pipeline_of)
):
    return await _generate(p, model, None, body, stream=True)


@router.post(
    "/v2/models/{model}/versions/{version}/generate_stream", summary="Generate as SSE, one version"
)
async def generate_stream_version(
    model: str, version: str, body: triton.GenerateRequest, p: Pipeline = Depends(pipeline_of)
):
    return await _generate(p, model, version, body, stream=True)


async def _generate(
    p: Pipeline, model: str, version: str | None, body: triton.GenerateRequest, stream: bool
):
    model = p.check_model(model)
    if version is not None and version not in MODEL_VERSIONS:
        raise APIError(
            ErrorKind.NOT_FOUND,
            f"model {model!r} has no version {version!r}; versions: {', '.join(MODEL_VERSIONS)}",
            "version",
        )
    req, _ = await p.translate(body, model, "generate", stream=stream)
    head = triton.Head(body.id, model, version or MODEL_VERSIONS[0])
    with_details = bool(body.params.details)
    if not stream:
        chunk = await p.collect(model, req, stop_key=body.id)
        return JSONResponse(triton.generate_response(head, chunk, with_details))
    chunks = await sse.peek(p.generate(model, req, stop_key=body.id), p.keepalive_s)
    events = triton.GenerateStream(head, with_details)
    return sse.EventStream(chunks, events.payloads, "triton")
