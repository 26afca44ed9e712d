"""MindIE's inference routes: `POST /infer` (text) and `POST /infer_token` (token ids), seed 000.

Both take the same body and differ only in which prompt field they name when neither is given;
errors are MindIE's {"error", "error_type"} (422 validation, 424 refused, 500 engine/timeout).
Streams peek the first chunk so that anything failing before the first token is an HTTP error;
after that an error is one SSE event in the same envelope.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from serve_app.ingress import sse
from serve_app.ingress.app import pipeline_of
from serve_app.ingress.pipeline import Pipeline
from serve_app.messages import ReplicaRequest, TokenizeRequest
from serve_app.protocol import mindie
from serve_app.protocol.errors import APIError
from serve_app.protocol.sampling import sampling_params

router = APIRouter(tags=["mindie"])
_DEFAULT_PRIORITY = 5
_DEFAULT_TIMEOUT_S = 600.0


@router.post("/infer", summary="Text inference (MindIE, seed 000 with `inputs`)")
async def infer(body: mindie.InferRequest, p: Pipeline = Depends(pipeline_of)):
    return await _infer(body, "inputs", p)


@router.post("/infer_token", summary="Token-id inference (MindIE, seed 000)")
async def infer_token(body: mindie.InferRequest, p: Pipeline = Depends(pipeline_of)):
    return await _infer(body, "input_id", p)


async def _infer(body: mindie.InferRequest, primary: str, p: Pipeline):
    param, value = body.prompt(primary)
    model = p.default_model  # MindIE's /infer has no model field: the first served model
    if param == "inputs":
        tok = TokenizeRequest(model=model, kind="text", text=value, param="inputs")  # type: ignore[arg-type]
    else:
        tok = TokenizeRequest(model=model, kind="token_ids", token_ids=value, param="input_id")  # type: ignore[arg-type]
    prompt = await p.tokenize(tok)
    params = body.params
    seed = body.seed()
    stream = bool(body.stream)
    req = ReplicaRequest(
        request_id=p.new_request_id("infer"),
        prompt_token_ids=prompt.prompt_token_ids,
        params=sampling_params(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            do_sample=params.do_sample,
            seed=seed,
            repetition_penalty=params.repetition_penalty,
            max_tokens=p.limits.output_limit(
                mindie.max_new_tokens(params), "parameters.max_new_tokens"
            ),
        ),
        priority=params.priority if params.priority is not None else _DEFAULT_PRIORITY,
        timeout_s=float(params.timeout) if params.timeout is not None else _DEFAULT_TIMEOUT_S,
        stream=stream,
        token_texts=stream,
    )
    with_details = bool(params.details)
    try:
        if not stream:
            chunk = await p.collect(model, req)
            return JSONResponse(mindie.infer_response(chunk, seed, with_details))
        chunks = await sse.peek(p.generate(model, req))
    except APIError as exc:
        raise _callback_timeout(exc) from None
    full_text = p.config.ServerConfig.fullTextEnabled
    events = mindie.InferStream(seed, with_details, full_text)
    return sse.sse_response(sse.rendered(chunks, events.payloads, "mindie"))


def _callback_timeout(exc: APIError) -> APIError:
    """MindIE words every timeout before the response as "Engine callback timeout: ..."
    (MINDIE.md); the replica's own deadline reports it in its own words."""
    prefix = "Engine callback timeout"
    if exc.kind != "timeout" or exc.message.startswith(prefix):
        return exc
    return APIError("timeout", f"{prefix}: {exc.message}", exc.param or "timeout")
