"""Odd input on every route is a 4xx in the route's own envelope, never a 500."""

from __future__ import annotations

import pytest

LONE_SURROGATE = '"a\\ud83d"'  # valid JSON, no valid text
TEXT_ROUTES = [
    ("/infer", '{"inputs": %s, "parameters": {"max_new_tokens": 1}}', 422, "inputs"),
    ("/v1/completions", '{"model": "demo", "prompt": %s, "max_tokens": 1}', 400, "prompt"),
    (
        "/v1/chat/completions",
        '{"model": "demo", "messages": [{"role": "user", "content": %s}], "max_tokens": 1}',
        400,
        "messages",
    ),
    ("/v2/models/demo/generate", '{"text_input": %s}', 400, "text_input"),
]


@pytest.mark.parametrize("path, template, status, param", TEXT_ROUTES)
def test_lone_surrogate_is_bad_input(client, path, template, status, param):
    response = client.post(path, content=template % LONE_SURROGATE)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert param in message and "surrogate" in message


@pytest.mark.parametrize(
    "method, path, status, shape",
    [
        ("GET", "/v1/chat/completions", 405, "openai"),
        ("POST", "/nope", 404, "mindie"),
        ("GET", "/infer", 405, "mindie"),
        ("GET", "/v2/models/demo/generate", 405, "triton"),
        ("POST", "/v1/nope", 404, "openai"),
    ],
)
def test_unknown_routes_and_methods_use_the_family_envelope(client, method, path, status, shape):
    response = client.request(method, path)
    assert response.status_code == status
    body = response.json()
    if shape == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}
    elif shape == "mindie":
        assert set(body) == {"error", "error_type"}
    else:
        assert set(body) == {"error"}


def test_broken_json_names_the_body(client):
    response = client.post("/v1/completions", content='{"model": "demo", "prompt": [1,')
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and error["message"].startswith("body is not valid JSON")
