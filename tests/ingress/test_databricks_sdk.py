"""The official databricks-sdk, unchanged, against the app served over real HTTP (`live_url`:
uvicorn in a thread, plain objects behind it, no Ray): it speaks `requests`, so it needs a
socket."""

from __future__ import annotations

import pytest

sdk = pytest.importorskip("databricks.sdk")
from databricks.sdk.errors import BadRequest, ResourceDoesNotExist  # noqa: E402
from databricks.sdk.service.serving import ChatMessage, ChatMessageRole  # noqa: E402


@pytest.fixture(scope="module")
def workspace(live_url):
    from databricks.sdk import WorkspaceClient

    return WorkspaceClient(host=live_url, token="any-token")


def test_list_and_get_endpoints(workspace):
    endpoints = list(workspace.serving_endpoints.list())
    assert [(e.name, e.task) for e in endpoints] == [
        ("demo", "llm/v1/chat"), ("minilm", "llm/v1/embeddings")
    ]  # fmt: skip
    assert endpoints[0].state.ready.value == "READY"
    assert workspace.serving_endpoints.get("demo").name == "demo"
    with pytest.raises(ResourceDoesNotExist, match="'nope' does not exist"):
        workspace.serving_endpoints.get("nope")


def test_query_chat(workspace):
    messages = [
        ChatMessage(role=ChatMessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=ChatMessageRole.USER, content="Hello"),
    ]
    reply = workspace.serving_endpoints.query("demo", messages=messages, max_tokens=4)
    assert reply.object.value == "chat.completion"
    assert reply.choices[0].message.role.value == "assistant"
    # (the SDK reads the finish reason from a "finishReason" key, which Databricks does not send
    # either: the raw HTTP tests check finish_reason)
    assert reply.usage.completion_tokens <= 4 and reply.usage.prompt_tokens > 2


def test_query_completions_batch(workspace):
    reply = workspace.serving_endpoints.query("demo", prompt=["one", "two"], max_tokens=3, n=2)
    assert reply.object.value == "text_completion"
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.completion_tokens <= 12


def test_errors_become_sdk_exceptions(workspace):
    with pytest.raises(BadRequest, match=r"temperature must be in \[0.0, 2.0\], got 2.5"):
        workspace.serving_endpoints.query(
            "demo", messages=[ChatMessage(role=ChatMessageRole.USER, content="x")],
            temperature=2.5,
        )  # fmt: skip
    with pytest.raises(ResourceDoesNotExist):
        workspace.serving_endpoints.query("nope", prompt="x")


def test_get_open_ai_client(workspace):
    with pytest.warns(DeprecationWarning):
        client = workspace.serving_endpoints.get_open_ai_client()
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model="demo", prompt="hi", max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_query_embeddings(workspace):
    reply = workspace.serving_endpoints.query("minilm", input=["a cat", "a kitten", "tax law"])
    assert reply.object.value == "list"
    vectors = [d.embedding for d in reply.data]
    similarity = [sum(x * y for x, y in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
    assert len(vectors[0]) == 384 and similarity[0] > similarity[1]
