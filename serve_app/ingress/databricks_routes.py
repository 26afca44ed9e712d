"""Routes of the Databricks Foundation Model API family (docs/apis.md#databricks-foundation-
model-apis).

- `POST /serving-endpoints/{name}/invocations`: the task follows the body (messages -> chat,
  prompt -> completions, input -> embeddings); errors in Databricks' `{"error_code", "message"}`.
- `POST /serving-endpoints/chat/completions`, `/serving-endpoints/completions`,
  `/serving-endpoints/embeddings` and `/serving-endpoints/responses` (the endpoint in `model`),
  so that `OpenAI(base_url=".../serving-endpoints")` works; errors in OpenAI's shape.
- `GET /api/2.0/serving-endpoints[/{name}]`: the endpoints, one per served model and one per
  embedding endpoint.
- `GET /.well-known/databricks-config`: what the databricks-sdk asks first; nothing to discover.

Each task is parse -> translate -> pipeline -> render like every family; a completion batch is
translated and run as one engine request per prompt.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from serve_app.ingress import sse
from serve_app.ingress.fan_out import gather_all
from serve_app.ingress.openai_routes import embeddings, responses
from serve_app.ingress.pipeline import Pipeline, pipeline_of
from serve_app.ingress.request_body import json_object, parse_body
from serve_app.messages import ErrorKind, ReplicaChunk
from serve_app.protocol.databricks_chat import DatabricksChatRequest
from serve_app.protocol.databricks_common import CHAT_TASK, EMBEDDINGS_TASK, endpoint
from serve_app.protocol.databricks_completions import (
    CompletionRenderer,
    DatabricksCompletionRequest,
)
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.errors import APIError, Family
from serve_app.protocol.openai_chat import ChatStream, chat_response
from serve_app.protocol.responses import ResponsesRequest
from serve_app.protocol.sampling import openai_finish
from serve_app.protocol.tool_calls import ToolCallStream, with_tool_calls

router = APIRouter(tags=["databricks"])
_TASKS = "messages (chat), prompt (completions) or input (embeddings)"


@router.get("/.well-known/databricks-config")
async def databricks_config() -> dict:
    """The databricks-sdk's discovery probe: no OAuth here, tokens are plain Bearer strings."""
    return {"oidc_endpoint": ""}


@router.get("/api/2.0/serving-endpoints")
async def list_endpoints(p: Pipeline = Depends(pipeline_of)) -> dict:
    ready = await p.backend.ready()
    return {"endpoints": [endpoint(n, task, p.created, ready) for n, task in _endpoints(p)]}


@router.get("/api/2.0/serving-endpoints/{name}")
async def get_endpoint(name: str, p: Pipeline = Depends(pipeline_of)) -> dict:
    tasks = dict(_endpoints(p))
    if name not in tasks:
        raise _no_endpoint(p, name)
    return endpoint(name, tasks[name], p.created, await p.backend.ready())


@router.post("/serving-endpoints/{name}/invocations")
async def invocations(name: str, request: Request, p: Pipeline = Depends(pipeline_of)):
    """One endpoint, the task chosen by the body's fields."""
    if name not in dict(_endpoints(p)):
        raise _no_endpoint(p, name)
    body = await json_object(request)
    if name in p.embedding_names:
        if "input" not in body:
            raise APIError(
                ErrorKind.VALIDATION, f"body must have input: {name!r} is an embedding endpoint",
                "input",
            )  # fmt: skip
        return await embeddings(parse_body(EmbeddingRequest, body), name, p)
    if "messages" in body:
        return await chat(parse_body(DatabricksChatRequest, body), name, p, "databricks")
    if "prompt" in body:
        request = parse_body(DatabricksCompletionRequest, body)
        return await completions(request, name, p, "databricks")
    if "input" in body:
        raise APIError(
            ErrorKind.VALIDATION,
            f"input is for embedding endpoints; {name!r} takes messages (chat) or prompt "
            "(completions)",
            "input",
        )
    raise APIError(ErrorKind.VALIDATION, f"body must have {_TASKS}", "body")


@router.post("/serving-endpoints/chat/completions")
async def openai_chat(body: DatabricksChatRequest, p: Pipeline = Depends(pipeline_of)):
    return await chat(body, p.check_model(_named(body.model)), p, "openai")


@router.post("/serving-endpoints/embeddings")
async def openai_embeddings(body: EmbeddingRequest, p: Pipeline = Depends(pipeline_of)):
    return await embeddings(body, _named(body.model), p)


@router.post("/serving-endpoints/responses")
async def openai_responses(body: ResponsesRequest, p: Pipeline = Depends(pipeline_of)):
    return await responses(body, p.check_model(_named(body.model)), p)


@router.post("/serving-endpoints/completions")
async def openai_completions(
    body: DatabricksCompletionRequest, p: Pipeline = Depends(pipeline_of)
):  # fmt: skip
    return await completions(body, p.check_model(_named(body.model)), p, "openai")


# -- the tasks ------------------------------------------------------------------------------


async def chat(body: DatabricksChatRequest, model: str, p: Pipeline, family: Family):
    req, prompt = await p.translate(body, model, "chatcmpl")
    created, logprobs, num_prompt = int(time.time()), bool(body.logprobs), prompt.num_prompt_tokens
    names = body.tool_names
    if not body.stream:
        chunk = await p.collect(model, req)
        response = chat_response(
            req.request_id, created, model, chunk, num_prompt, logprobs, finish=openai_finish
        )
        return response if names is None else with_tool_calls(response, names)
    chunks = await sse.peek(p.generate(model, req), p.keepalive_s)
    stream = ChatStream(
        req.request_id, created, model, num_prompt, logprobs, body.include_usage, openai_finish
    )
    events = stream.events if names is None else ToolCallStream(stream.events, names).events
    return sse.EventStream(chunks, events, family, done=True)


async def completions(body: DatabricksCompletionRequest, model: str, p: Pipeline, family: Family):
    body.check(p.defaults.pd_mode)
    translated = await gather_all(p.translate(one, model, "cmpl") for one in body.per_prompt())
    reqs = [req for req, _ in translated]
    render = CompletionRenderer(body, p.new_request_id("cmpl"), int(time.time()), model)
    if not body.stream:
        return render.response(await p.collect_many(model, reqs, body.truncate))
    items = await sse.peek(p.generate_many(model, reqs, body.truncate), p.keepalive_s)

    def events(item: tuple[int | None, ReplicaChunk | None]) -> list[dict]:
        prompt, chunk = item
        if prompt is None:
            return [render.usage_event()] if body.include_usage else []
        if chunk is None:  # timed out under error_behavior "truncate"
            return render.timeout_events(prompt)
        return render.events(prompt, chunk)

    return sse.EventStream(items, events, family, done=True)


# -- helpers --------------------------------------------------------------------------------


def _endpoints(p: Pipeline) -> list[tuple[str, str]]:
    """(endpoint name, task): a chat endpoint per served model (it completes prompts too),
    then the embedding endpoints."""
    return [(name, CHAT_TASK) for name in p.model_names] + [
        (name, EMBEDDINGS_TASK) for name in p.embedding_names
    ]


def _no_endpoint(p: Pipeline, name: str) -> APIError:
    served = ", ".join(n for n, _ in _endpoints(p))
    return APIError(
        ErrorKind.NOT_FOUND, f"endpoint {name!r} does not exist; endpoints: {served}", "name"
    )


def _named(model: str | None) -> str:
    if model is None:
        raise APIError(ErrorKind.VALIDATION, "model is required: the endpoint name", "model")
    return model
