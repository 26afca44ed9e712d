"""POST /tokenize and /detokenize, as vLLM serves them (protocol/tokenize.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.ingress.request_body import json_object, parse_body
from serve_app.protocol.tokenize import (
    Detokenize,
    TokenizeChat,
    TokenizeCompletion,
    tokenize_response,
)

router = APIRouter(tags=["tokenizer"])


@router.post("/tokenize")
async def tokenize(request: Request, p: Pipeline = Depends(pipeline_of)):
    """A prompt, or chat messages through the chat template, as the model's token ids."""
    body = await json_object(request)
    kind = TokenizeChat if "messages" in body else TokenizeCompletion
    parsed = parse_body(kind, body)
    model = p.check_model(parsed.model)
    prompt = await p.tokenize(parsed.tokenize_request(model))
    return tokenize_response(parsed, prompt, p.defaults.limits.max_seq_len)  # as /v1/models


@router.post("/detokenize")
async def detokenize(request: Request, p: Pipeline = Depends(pipeline_of)):
    """Token ids back to text (special tokens kept)."""
    parsed = parse_body(Detokenize, await json_object(request))
    prompt = await p.tokenize(parsed.tokenize_request(p.check_model(parsed.model)))
    return {"prompt": prompt.prompt_text}
