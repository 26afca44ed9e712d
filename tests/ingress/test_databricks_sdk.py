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


def test_explicit_nulls_from_the_openai_client_mean_not_given(live_url):
    """The openai client sends null for every argument given as None (here through Databricks'
    OpenAI-compatible paths, as `get_open_ai_client` points it): each is the field not given."""
    import openai

    client = openai.OpenAI(base_url=f"{live_url}/serving-endpoints", api_key="x", max_retries=0)
    nulls = {"use_raw_prompt": None, "error_behavior": None, "n": None}
    plain = client.completions.create(model="demo", prompt="hi", max_tokens=3, temperature=0)
    given = client.completions.create(
        model="demo", prompt="hi", max_tokens=3, temperature=0, suffix=None, echo=None,
        stop=None, top_p=None, extra_body=nulls,
    )  # fmt: skip
    assert given.choices[0].text == plain.choices[0].text
    vectors = client.embeddings.create(model="minilm", input=["a cat"], encoding_format=None)
    assert len(vectors.data[0].embedding) == 384
