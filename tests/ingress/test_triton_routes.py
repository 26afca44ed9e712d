"""Triton generate / generate_stream over the in-process app (demo-tiny): {"error"}
envelope, response shapes, stop strings, timeouts, stopInfer and freed KV blocks."""

from __future__ import annotations

import json
import threading

import pytest

from tests.ingress.conftest import LONG_MAX_TOKENS

GENERATE_EXAMPLE = {  # the generate request of Triton's documentation
    "id": "42",
    "text_input": "client input",
    "parameters": {"stream": False, "temperature": 0},
}
GEN, STREAM = "/v2/models/demo/generate", "/v2/models/demo/generate_stream"
ROUTES = [GEN, STREAM, "/v2/models/demo/versions/1/generate"]

BAD = [
    ("temperature", -1, "parameters.temperature must be >= 0.0, got -1"),
    ("max_tokens", 0, "parameters.max_tokens must be in (0, 2147483647], got 0"),
    ("max_new_tokens", 2**31, "parameters.max_new_tokens must be in (0, 2147483647]"),
    ("top_k", 0, "parameters.top_k must be in (0, 2147483647]"),
    ("top_p", 0, "parameters.top_p must be in (0.0, 1.0]"),
    ("top_p", 1.5, "parameters.top_p must be in (0.0, 1.0]"),
    ("do_sample", "no", "parameters.do_sample"),
    ("seed", 0, "parameters.seed must be in (0, 18446744073709551615]"),
    ("repetition_penalty", 0, "parameters.repetition_penalty must be > 0.0"),
    ("typical_p", 2, "parameters.typical_p must be in (0.0, 1.0]"),
    ("watermark", "x", "parameters.watermark"),
    ("details", 1, "parameters.details"),
    ("batch_size", 0, "parameters.batch_size must be in [1, 2147483647]"),
    ("perf_stat", "x", "parameters.perf_stat"),
    ("priority", 9, "parameters.priority must be in [1, 5]"),
    ("timeout", 0, "parameters.timeout must be in (0, 3600]"),
    ("stream", 1, "parameters.stream"),
    ("stop", "", "parameters.stop must be a non-empty string"),
    ("stop", [1], "parameters.stop must be a string or a list of strings"),
]


def events(response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")
    ]


def assert_triton_error(response, status, *words):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    for word in words:
        assert word in body["error"], body["error"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("name", "value", "words"), BAD)
def test_bad_parameter_is_400(client, route, name, value, words):
    body = {"text_input": "hi", "parameters": {name: value}}
    assert_triton_error(client.post(route, json=body), 400, words)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({}, ["text_input is required"]),
        ({"text_input": ""}, ["text_input must have between 1 and"]),
        ({"text_input": "x" * 4000}, ["text_input must have between 1 and 256 tokens"]),
        ({"text_input": "x", "id": 42}, ["id"]),
        ({"text_input": "x", "max_tokens": 0}, ["max_tokens must be in (0, 2147483647]"]),
        (
            {"text_input": "x", "max_tokens": 3, "parameters": {"max_tokens": 4}},
            ["max_tokens (3) and parameters.max_tokens (4) conflict"],
        ),
        ({"text_input": "x", "parameters": {"max_tokens": 3, "max_new_tokens": 4}}, ["conflict"]),
    ],
)
def test_bad_body_is_400(client, body, words):
    for route in (GEN, STREAM):
        assert_triton_error(client.post(route, json=body), 400, *words)


def test_unknown_model_or_version_is_404(client):
    body = {"text_input": "x"}
    assert_triton_error(client.post("/v2/models/nope/generate", json=body), 404, "nope")
    assert_triton_error(client.post("/v2/models/nope/generate_stream", json=body), 404, "nope")
    versioned = "/v2/models/demo/versions/7/generate"
    assert_triton_error(client.post(versioned, json=body), 404, "version")


def test_documented_example(client):
    response = client.post(GEN, json=GENERATE_EXAMPLE)
    assert response.status_code == 200, response.text
    out = response.json()
    assert list(out) == ["id", "model_name", "model_version", "text_output"]
    assert out["id"] == "42" and out["model_name"] == "demo" and out["model_version"] == "1"
    assert isinstance(out["text_output"], str) and out["text_output"]
    assert client.post(GEN, json=GENERATE_EXAMPLE).json() == out  # temperature 0 is greedy
    versioned = client.post("/v2/models/demo/versions/1/generate", json=GENERATE_EXAMPLE).json()
    assert versioned == out
    no_id = client.post(GEN, json={k: v for k, v in GENERATE_EXAMPLE.items() if k != "id"}).json()
    assert "id" not in no_id and no_id["text_output"] == out["text_output"]


def test_details_and_stream_match_non_stream(client):
    params = {"temperature": 0, "max_tokens": 10, "details": True}
    out = client.post(GEN, json={"id": "d1", "text_input": "abc", "parameters": params}).json()
    details = out["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 10
    assert isinstance(details["first_token_cost"], float)
    assert len(details["decode_cost"]) == 9
    assert len(details["batch_size"]) == len(details["queue_wait_time"]) == 10
    response = client.post(STREAM, json={"id": "d2", "text_input": "abc", "parameters": params})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response)
    assert all(e["id"] == "d2" and e["model_name"] == "demo" for e in got)
    assert all(e["model_version"] == "1" for e in got)
    assert "".join(e["text_output"] for e in got) == out["text_output"]
    assert all("details" not in e for e in got[:-1])
    assert got[-1]["details"]["generated_tokens"] == 10


def test_seeded_requests_reproduce(client):
    params = {"temperature": 1.5, "seed": 77, "max_new_tokens": 12}
    body = {"text_input": "once upon", "parameters": params}
    first = client.post(GEN, json=body).json()
    assert client.post(GEN, json=body).json() == first
    # the seed is what makes it reproducible: another seed samples another text
    other = {**body, "parameters": {**params, "seed": 78}}
    assert client.post(GEN, json=other).json()["text_output"] != first["text_output"]


def test_stop_string_ends_the_text(client):
    params = {"temperature": 0, "max_tokens": 20, "details": True}
    full = client.post(GEN, json={"text_input": "abc", "parameters": params}).json()["text_output"]
    stop = full[8:11]
    cut = full[: full.index(stop)]
    out = client.post(GEN, json={"text_input": "abc", "parameters": {**params, "stop": [stop]}})
    assert out.json()["text_output"] == cut
    assert out.json()["details"]["finish_reason"] == "stop_sequence"


def test_a_tensorrt_llm_style_body_is_obeyed(client):
    """TensorRT-LLM's clients put their parameters at the top level of the request object;
    Triton passes those on as parameters, so they must act as if sent in `parameters`."""
    trt = {"text_input": "abc", "max_tokens": 6, "temperature": 0, "bad_words": "",
           "stop_words": "", "stream": False, "end_id": 2}  # fmt: skip
    out = client.post(GEN, json={**trt, "details": True}).json()
    assert out["details"]["generated_tokens"] == 6
    nested = {"text_input": "abc", "parameters": {"max_tokens": 6, "temperature": 0}}
    assert out["text_output"] == client.post(GEN, json=nested).json()["text_output"]
    # greedy, not sampled at the default temperature: the same text every time
    assert client.post(GEN, json=trt).json()["text_output"] == out["text_output"]
    streamed = events(client.post(STREAM, json=trt))
    assert "".join(e["text_output"] for e in streamed) == out["text_output"]


def test_stop_words_are_stop_strings(client):
    params = {"temperature": 0, "max_tokens": 20, "details": True}
    full = client.post(GEN, json={"text_input": "abc", **params}).json()["text_output"]
    stop = full[8:11]
    out = client.post(GEN, json={"text_input": "abc", **params, "stop_words": [stop, ""]}).json()
    assert out["text_output"] == full[: full.index(stop)]
    assert out["details"]["finish_reason"] == "stop_sequence"


def test_bad_words_never_appear_in_the_output(client, kv_idle):
    params = {"temperature": 0, "max_tokens": 12, "details": True}
    full = client.post(GEN, json={"text_input": "abc", **params}).json()["text_output"]
    words = full.split()
    banned = words[len(words) // 2]  # the greedy path spells it: the ban must turn it away
    for where in ({"bad_words": [banned]}, {"parameters": {"bad_words": banned}}):
        out = client.post(GEN, json={"text_input": "abc", **params, **where})
        assert out.status_code == 200, out.text
        text = out.json()["text_output"]
        assert banned not in text.split() and text != full, (banned, full, text)
        assert out.json()["details"]["generated_tokens"] == 12
    assert kv_idle()


def test_timeout_is_500_or_an_error_event(long_client, engine_watch):
    body = {
        "text_input": "a long story",  # greedy: only its length would end it otherwise
        "parameters": {"max_tokens": LONG_MAX_TOKENS, "temperature": 0, "timeout": 0.05},
    }
    assert_triton_error(long_client.post(GEN, json=body), 500, "time")
    engine_watch.freed_early()
    engine_watch.steps = 0
    body["parameters"]["timeout"] = 0.4
    response = long_client.post(STREAM, json=body)
    assert response.status_code == 200
    got = events(response)
    assert set(got[-1]) == {"error"} and "time" in got[-1]["error"]
    assert all("error" not in e for e in got[:-1])
    engine_watch.freed_early()


def _stream_in_thread(client, body: dict) -> tuple[threading.Thread, threading.Event, dict]:
    """Streams body to generate_stream on a thread: (the thread, an event set once the first
    event arrived, where its events end up)."""
    first, result = threading.Event(), {"events": []}

    def run():
        with client.stream("POST", STREAM, json=body) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(json.loads(line[6:]))
                    first.set()
        first.set()  # ended without any event: let the test see it

    thread = threading.Thread(target=run)
    thread.start()
    return thread, first, result


# Triton's id is any string: each is echoed and addresses stopInfer
@pytest.mark.parametrize("request_id", ["stop-me", "run 7: step.3", ""])
def test_stop_infer_ends_a_running_stream(long_client, engine_watch, request_id):
    body = {
        "id": request_id,
        "text_input": "a long story",  # greedy: no EOS to end it early
        "parameters": {"max_tokens": LONG_MAX_TOKENS, "temperature": 0, "details": True},
    }
    thread, first, result = _stream_in_thread(long_client, body)
    assert first.wait(60), "no event within 60 s"
    assert result["status"] == 200 and result["events"], result
    assert all(e["id"] == request_id for e in result["events"])
    stopped = long_client.post("/v2/models/demo/stopInfer", json={"id": request_id})
    assert stopped.status_code == 200 and stopped.json() == {"id": request_id}
    thread.join(60)
    assert not thread.is_alive(), "the stream did not end after stopInfer"
    got = result["events"]
    assert all("error" not in e for e in got)
    assert got[-1]["details"]["finish_reason"] == "stop_sequence"
    assert 1 <= got[-1]["details"]["generated_tokens"] < LONG_MAX_TOKENS
    assert all("details" not in e for e in got[:-1])
    engine_watch.freed_early()
    gone = long_client.post("/v2/models/demo/stopInfer", json={"id": request_id})
    assert gone.status_code == 404  # the id is free again once the request ended


def test_client_leaving_a_stream_frees_blocks(long_client, engine_watch):
    body = {"text_input": "a long story",  # greedy: no EOS to end it early
            "parameters": {"max_tokens": LONG_MAX_TOKENS, "temperature": 0}}  # fmt: skip
    with long_client.stream("POST", STREAM, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first text arrived: hang up
    engine_watch.freed_early()
