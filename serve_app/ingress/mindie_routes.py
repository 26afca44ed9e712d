"""MindIE's inference routes: `POST /infer` (text) and `POST /infer_token` (token ids).

Both take the same body and differ only in which prompt field they name when neither is given;
errors are MindIE's {"error", "error_type"} (docs/apis.md#mindie-infer-and-infer_token). Streams
peek the first chunk so that anything failing before the first token is an HTTP error; after
that an error is one SSE event in the same envelope.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from serve_app.ingress import sse
from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.protocol import mindie

router = APIRouter(tags=["mindie"])


@router.post("/infer", summary="Text inference (MindIE, `inputs`)")
async def infer(body: mindie.InferRequest, p: Pipeline = Depends(pipeline_of)):
    return await _infer(body, p)


@router.post("/infer_token", summary="Token-id inference (MindIE, `input_id`)")
async def infer_token(body: mindie.InferTokenRequest, p: Pipeline = Depends(pipeline_of)):
    return await _infer(body, p)


async def _infer(body: mindie.InferRequest, p: Pipeline):
    model = p.default_model  # MindIE's /infer has no model field: the first served model
    req, _ = await p.translate(body, model, "infer")
    seed, with_details = body.seed(), bool(body.params.details)
    if not req.stream:
        return JSONResponse(mindie.infer_response(await p.collect(model, req), seed, with_details))
    chunks = await sse.peek(p.generate(model, req), p.keepalive_s)
    events = mindie.InferStream(seed, with_details, p.config.ServerConfig.fullTextEnabled)
    return sse.EventStream(chunks, events.payloads, "mindie")
