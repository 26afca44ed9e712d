"""Routes of the OpenAI-shaped family: POST /v1/chat/completions, /v1/completions,
/v1/embeddings (an embedding endpoint named in `model`) and /v1/responses.

Each route: translate (the request's ranges, then its cross-rules and PD refusals, so bad input
costs no model work; then the tokenizer pool), then either collect the replica's chunks into one
body or stream them as SSE. The stream's first chunk is peeked, so a request the engine refuses
is still an HTTP error; an error after the 200 is one `data: {"error": ...}` event followed by
[DONE]. Errors are rendered as OpenAI error objects by the app (path /v1/*; docs/apis.md#errors).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from serve_app.ingress import sse
from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.messages import ErrorKind, ReplicaChunk
from serve_app.protocol.embeddings import EmbeddingRequest, embedding_response
from serve_app.protocol.errors import APIError
from serve_app.protocol.openai_chat import ChatCompletionRequest, ChatStream, chat_response
from serve_app.protocol.openai_completions import (
    CompletionRequest,
    CompletionStream,
    completion_response,
)
from serve_app.protocol.responses import ResponsesRequest
from serve_app.protocol.responses_render import ResponseBuilder, ResponseStream, sse_event

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, p: Pipeline = Depends(pipeline_of)):
    """Chat with the model through its chat template."""
    model = p.check_model(body.model)
    req, prompt = await p.translate(body, model, "chatcmpl")
    created, logprobs, num_prompt = int(time.time()), bool(body.logprobs), prompt.num_prompt_tokens
    if not body.stream:
        chunk = await p.collect(model, req)
        return chat_response(req.request_id, created, model, chunk, num_prompt, logprobs)
    chunks = await sse.peek(p.generate(model, req), p.keepalive_s)
    stream = ChatStream(req.request_id, created, model, num_prompt, logprobs, body.include_usage)
    return sse.EventStream(chunks, stream.events, "openai", done=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, p: Pipeline = Depends(pipeline_of)):
    """Complete a prompt (beam search streams as one event)."""
    model = p.check_model(body.model)
    req, prompt = await p.translate(body, model, "cmpl")
    created, num_prompt = int(time.time()), prompt.num_prompt_tokens
    logprobs = body.logprobs is not None

    def whole(chunk: ReplicaChunk) -> dict:
        return completion_response(req.request_id, created, model, chunk, num_prompt, logprobs)

    if not body.stream:
        return whole(await p.collect(model, req))
    chunks = await sse.peek(p.generate(model, req), p.keepalive_s)
    if body.fake_stream:  # the replica sends one final chunk (req.stream is False)
        return sse.EventStream(chunks, lambda chunk: [whole(chunk)], "openai", done=True)
    stream = CompletionStream(req.request_id, created, model, num_prompt, logprobs)
    return sse.EventStream(chunks, stream.events, "openai", done=True)


@router.post("/v1/embeddings")
async def v1_embeddings(body: EmbeddingRequest, p: Pipeline = Depends(pipeline_of)):
    """Embed one input or a batch on an embedding endpoint (its name in `model`)."""
    if body.model is None:
        raise APIError(ErrorKind.VALIDATION, "model is required: the embedding endpoint", "model")
    return await embeddings(body, body.model, p)


async def embeddings(body: EmbeddingRequest, endpoint: str, p: Pipeline) -> dict:
    """The embeddings task, shared with the Databricks routes."""
    result = await p.embed(endpoint, body.embed_request())
    body.check_dimensions(len(result.vectors[0]))
    return embedding_response(p.new_request_id("embd"), endpoint, result, body.encoding_format)


@router.post("/v1/responses")
async def v1_responses(body: ResponsesRequest, p: Pipeline = Depends(pipeline_of)):
    """The Responses API: input items in, typed output items (and stream events) out."""
    if body.model is None:
        raise APIError(ErrorKind.VALIDATION, "model is required", "model")
    return await responses(body, p.check_model(body.model), p)


async def responses(body: ResponsesRequest, model: str, p: Pipeline):
    """The Responses task, shared with the Databricks routes."""
    req, prompt = await p.translate(body, model, "resp")
    builder = ResponseBuilder(body, model, prompt.num_prompt_tokens)
    if not body.stream:
        return builder.response(await p.collect(model, req))
    chunks = await sse.peek(p.generate(model, req), p.keepalive_s)
    stream = ResponseStream(builder)
    return sse.EventStream(
        chunks, stream.events, "openai", frame=sse_event, error_event=stream.error
    )
