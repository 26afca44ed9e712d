"""POST /infer and /infer_token over the in-process app (demo-tiny): validation envelope, the
documented shapes (stream and not), seeds, priority/timeout reaching the engine, and freed KV
blocks."""

from __future__ import annotations

import json
import time

import pytest

from tests.ingress.conftest import LONG_MAX_TOKENS

EXAMPLE = {  # MindIE's documented /infer_token request
    "input_id": [5618, 19678, 701, 9072, 13],
    "stream": False,
    "parameters": {
        "temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True,
        "seed": None, "repetition_penalty": 1.03, "details": True, "typical_p": 0.5,
        "watermark": False, "priority": 5, "timeout": 10,
    },
}  # fmt: skip
PROMPTS = {
    "/infer": {"inputs": "My name is Olivier and I"},
    "/infer_token": {"input_id": [5, 6, 7]},
}
# On the long app (long_client): thousands of engine steps unless something ends it early
# (greedy: the demo model never draws EOS then, so only its length could end it otherwise)
LONG_GEN = {"max_new_tokens": LONG_MAX_TOKENS, "do_sample": False}

# (parameter, bad value, words the message must contain)
BAD = [
    ("temperature", 0, "parameters.temperature must be > 0.0, got 0"),
    ("top_k", 0, "parameters.top_k must be in (0, 2147483647], got 0"),
    ("top_p", 1.0, "parameters.top_p must be in (0.0, 1.0), got 1.0"),
    ("top_p", 0, "parameters.top_p must be in (0.0, 1.0)"),
    ("max_new_tokens", 0, "parameters.max_new_tokens must be in (0, 2147483647]"),
    ("max_new_tokens", 2**31, "parameters.max_new_tokens must be in (0, 2147483647]"),
    ("do_sample", "yes", "parameters.do_sample"),
    ("seed", 0, "parameters.seed must be in (0, 18446744073709551615]"),
    ("seed", 2**64, "parameters.seed must be in (0, 18446744073709551615]"),
    ("repetition_penalty", 0, "parameters.repetition_penalty must be > 0.0"),
    ("details", "true", "parameters.details"),
    ("typical_p", 1.5, "parameters.typical_p must be in (0.0, 1.0]"),
    ("typical_p", 0, "parameters.typical_p must be in (0.0, 1.0]"),
    ("watermark", 1, "parameters.watermark"),
    ("priority", 0, "parameters.priority must be in [1, 5]"),
    ("priority", 6, "parameters.priority must be in [1, 5]"),
    ("timeout", 0, "parameters.timeout must be in (0, 3600]"),
    ("timeout", 3601, "parameters.timeout must be in (0, 3600]"),
]


def assert_mindie_422(response, *words):
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}
    assert body["error_type"] == "Input Validation Error"
    for word in words:
        assert word in body["error"], body["error"]


def events(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]


@pytest.mark.parametrize("route", ["/infer", "/infer_token"])
@pytest.mark.parametrize(("name", "value", "words"), BAD)
def test_bad_parameter(client, route, name, value, words):
    body = {**PROMPTS[route], "parameters": {name: value}}
    assert_mindie_422(client.post(route, json=body), words)
    assert_mindie_422(client.post(route, json={**body, "stream": True}), words)


@pytest.mark.parametrize(
    ("route", "body", "words"),
    [
        ("/infer", {"inputs": "x", "input_id": [1]}, ["Input conflict.", "inputs", "input_id"]),
        ("/infer_token", {"inputs": "x", "input_id": [1]}, ["Input conflict."]),
        ("/infer", {}, ["inputs is required"]),
        ("/infer_token", {"parameters": {}}, ["input_id is required"]),
        ("/infer", {"inputs": ""}, ["inputs must have between 1 and"]),
        ("/infer", {"inputs": 7}, ["inputs"]),
        ("/infer_token", {"input_id": []}, ["input_id must have between 1 and 256 tokens"]),
        ("/infer_token", {"input_id": [1] * 257}, ["input_id must have between 1 and 256"]),
        ("/infer_token", {"input_id": [1, -1]}, ["input_id[1] must be a token id in [0,"]),
        ("/infer_token", {"input_id": [2**20 + 1]}, ["input_id[0] must be a token id"]),
        ("/infer_token", {"input_id": [1, "2"]}, ["input_id[1]"]),
        ("/infer_token", {"input_id": [1], "stream": "true"}, ["stream"]),
        ("/infer_token", [1, 2], ["body must be a JSON object"]),
    ],
)
def test_bad_body(client, route, body, words):
    assert_mindie_422(client.post(route, json=body), *words)


def test_body_not_json(client):
    response = client.post("/infer", content=b"{nope", headers={"content-type": "application/json"})
    assert_mindie_422(response, "not valid JSON")


@pytest.mark.parametrize("route", ["/infer_token", "/infer"])
def test_documented_example_non_stream(client, route):
    body = {**EXAMPLE, **({} if route == "/infer_token" else {"input_id": None, **PROMPTS[route]})}
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert set(out) == {"generated_text", "details"}
    assert isinstance(out["generated_text"], str) and out["generated_text"]
    assert set(out["details"]) == {"finish_reason", "generated_tokens", "seed"}
    assert out["details"]["finish_reason"] == "length"
    assert out["details"]["generated_tokens"] == 20
    assert isinstance(out["details"]["seed"], int) and out["details"]["seed"] > 0
    no_details = {**body, "parameters": {**body["parameters"], "details": False}}
    assert set(client.post(route, json=no_details).json()) == {"generated_text"}


def test_documented_example_stream(client):
    response = client.post("/infer_token", json={**EXAMPLE, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response)
    assert len(got) == 20  # one event per generated token
    first, *middle, last = got
    assert set(first) == {"prefill_time", "decode_time", "token"}
    assert isinstance(first["prefill_time"], float) and first["decode_time"] is None
    for event in middle:
        assert set(event) == {"prefill_time", "decode_time", "token"}
        assert event["prefill_time"] is None and isinstance(event["decode_time"], float)
        assert set(event["token"]) == {"id", "text"} and isinstance(event["token"]["id"], int)
    assert list(last) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last["prefill_time"] is None and isinstance(last["decode_time"], float)
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    assert set(last["details"]) == {"finish_reason", "generated_tokens", "seed"}
    assert last["details"]["generated_tokens"] == 20
    streamed = "".join(e["token"]["text"] for e in [first, *middle])
    assert last["generated_text"].startswith(streamed)  # the last token's text only here


def test_seeded_requests_reproduce_and_stream_matches(client):
    params = {"temperature": 1.5, "seed": 1234, "details": True, "max_new_tokens": 12}
    a = client.post("/infer", json={"inputs": "Hello there", "parameters": params}).json()
    b = client.post("/infer", json={"inputs": "Hello there", "parameters": params}).json()
    assert a == b and a["details"]["seed"] == 1234
    streamed = events(
        client.post("/infer", json={"inputs": "Hello there", "stream": True, "parameters": params})
    )
    assert streamed[-1]["generated_text"] == a["generated_text"]


def test_a_server_drawn_seed_reproduces_the_answer(client):
    sampled = {"temperature": 1.5, "details": True, "max_new_tokens": 12}
    drawn = client.post("/infer", json={"inputs": "Hi", "parameters": sampled}).json()
    seed = drawn["details"]["seed"]
    assert isinstance(seed, int) and 0 < seed < 2**64

    def answer(seed: int) -> dict:
        body = {"inputs": "Hi", "parameters": {**sampled, "seed": seed}}
        return client.post("/infer", json=body).json()

    # the seed the server reported is the one it sampled with: sent back, it gives that answer
    again = answer(seed)
    assert again["generated_text"] == drawn["generated_text"]
    assert again["details"] == drawn["details"]
    # and the answer depends on the seed: another one samples another text (12 tokens at
    # temperature 1.5 on the demo model: equal texts would take ~25% odds twelve times over)
    other = answer(seed % (2**64 - 1) + 1)
    assert other["details"]["seed"] != seed
    assert other["generated_text"] != drawn["generated_text"]
    # a second drawn seed is a fresh one (not a constant that happens to reproduce)
    redrawn = client.post("/infer", json={"inputs": "Hi", "parameters": sampled}).json()
    assert redrawn["details"]["seed"] != seed


def test_priority_and_timeout_reach_the_engine(client, monkeypatch):
    engine = client.app.state.replica.engine
    seen = []
    original = engine.feeding

    def spy(request, take):
        seen.append(request)
        return original(request, take)

    monkeypatch.setattr(engine, "feeding", spy)
    before = time.monotonic()
    body = {"input_id": [1, 2, 3], "parameters": {"priority": 2, "timeout": 30, "do_sample": False}}
    assert client.post("/infer_token", json=body).status_code == 200
    (request,) = seen
    assert request.priority == 2
    assert before + 29 < request.deadline < time.monotonic() + 30
    assert request.params.is_greedy


def test_timeout_non_stream_is_500_and_frees_blocks(long_client, engine_watch):
    body = {"inputs": "tell me a long story", "parameters": {**LONG_GEN, "timeout": 0.05}}
    response = long_client.post("/infer", json=body)
    assert response.status_code == 500
    out = response.json()
    assert out["error_type"] == "Incomplete Generation"
    assert out["error"].startswith("Engine callback timeout")
    engine_watch.freed_early()


def test_timeout_in_stream_is_an_error_event(long_client, engine_watch):
    body = {"inputs": "tell me a long story", "stream": True, "parameters": {**LONG_GEN}}
    body["parameters"]["timeout"] = 0.4
    response = long_client.post("/infer", json=body)
    assert response.status_code == 200
    got = events(response)
    assert set(got[-1]) == {"error", "error_type"}
    assert got[-1]["error_type"] == "Incomplete Generation"
    # after the 200, in the replica's words (the "Engine callback timeout" wording is for a
    # timeout before the response starts)
    assert got[-1]["error"] == "request timed out after 0.4 s (its timeout)"
    assert 1 <= len(got) - 1 < LONG_MAX_TOKENS - 1  # some tokens came, then the error
    assert all(set(e) == {"prefill_time", "decode_time", "token"} for e in got[:-1])
    engine_watch.freed_early()


def test_client_leaving_a_stream_frees_blocks(long_client, engine_watch):
    body = {"inputs": "tell me a long story", "stream": True, "parameters": LONG_GEN}
    with long_client.stream("POST", "/infer", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived: hang up
    engine_watch.freed_early()
