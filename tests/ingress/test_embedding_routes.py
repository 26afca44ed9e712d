"""Embeddings over HTTP in process: /v1/embeddings, /serving-endpoints/embeddings and the
Databricks invocation of an embedding endpoint, with the real all-MiniLM-L6-v2."""

from __future__ import annotations

import math

import openai
import pytest

INVOKE = "/serving-endpoints/minilm/invocations"
RELATED = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The stock market fell sharply today."


def _cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_invocation_batch_shape_and_meaning(client):
    r = client.post(INVOKE, json={"input": [*RELATED, UNRELATED]})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["model"] == "minilm"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(d["object"] == "embedding" for d in body["data"])
    assert all(len(v) == 384 and math.isclose(_cos(v, v), 1.0, rel_tol=1e-5) for v in vectors)
    assert _cos(vectors[0], vectors[1]) > _cos(vectors[0], vectors[2]) + 0.3
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 3 * 2


def test_instruction_is_put_before_every_input(client):
    plain = client.post(INVOKE, json={"input": "bread"}).json()
    ruled = client.post(
        INVOKE, json={"input": "bread", "instruction": "Represent this sentence:"}
    ).json()
    assert ruled["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert ruled["data"][0]["embedding"] != plain["data"][0]["embedding"]


def test_openai_client_on_both_paths(client):
    for base in ("http://testserver/v1", "http://testserver/serving-endpoints"):
        oai = openai.OpenAI(base_url=base, api_key="x", http_client=client)
        # the client asks for base64 by default and decodes it
        got = oai.embeddings.create(model="minilm", input=[RELATED[0], UNRELATED])
        assert [len(d.embedding) for d in got.data] == [384, 384]
        floats = oai.embeddings.create(model="minilm", input=RELATED[0], encoding_format="float")
        assert floats.data[0].embedding == pytest.approx(got.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    "path, body, status, shape, message",
    [
        (INVOKE, {"input": ""}, 400, "databricks", "input must be a non-empty string"),
        (INVOKE, {"input": ["ok", "word " * 300]}, 400, "databricks", "input[1] is"),
        (INVOKE, {"messages": [{"role": "user", "content": "x"}]}, 400, "databricks",
         "body must have input: 'minilm' is an embedding endpoint"),
        ("/serving-endpoints/demo/invocations", {"input": "x"}, 400, "databricks",
         "input is for embedding endpoints"),
        ("/v1/embeddings", {"model": "demo", "input": "x"}, 404, "openai",
         "embedding endpoint 'demo' is not served here"),
        ("/v1/embeddings", {"input": "x"}, 400, "openai", "model is required"),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 12}, 400, "openai",
         "dimensions must be 384"),
        ("/serving-endpoints/embeddings", {"model": "minilm", "input": [1, 2]}, 400, "openai",
         "input must be a non-empty string or a list"),
    ],
)  # fmt: skip
def test_errors(client, path, body, status, shape, message):
    r = client.post(path, json=body)
    assert r.status_code == status
    text = r.json()["message"] if shape == "databricks" else r.json()["error"]["message"]
    assert message in text


def test_listed_as_an_embeddings_endpoint(client):
    listed = client.get("/api/2.0/serving-endpoints").json()["endpoints"]
    assert ("minilm", "llm/v1/embeddings") in [(e["name"], e["task"]) for e in listed]
