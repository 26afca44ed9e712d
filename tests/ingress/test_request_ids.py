"""Request ids (ingress/request_ids.py) and internal errors: every answer carries X-Request-ID;
an unexpected failure is answered in the family's envelope naming that id, with no exception
text, path or stack, and the log has the details under the same id."""

from __future__ import annotations

import json
import logging
import re

import pytest

SECRET = "/srv/secret/weights.py"
COMPLETION = {"model": "demo", "prompt": "hello", "max_tokens": 8}


def test_every_answer_has_a_request_id(client):
    drawn = client.post("/v1/completions", json=COMPLETION)
    assert re.fullmatch(r"[0-9a-f]{32}", drawn.headers["x-request-id"])
    other = client.post("/v1/completions", json=COMPLETION)
    assert other.headers["x-request-id"] != drawn.headers["x-request-id"]
    mine = client.post("/infer", json={"inputs": "hi"}, headers={"X-Request-ID": "abc-1.2:3"})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "abc-1.2:3"
    odd = client.get("/nope", headers={"X-Request-ID": "a b\\c" + "x" * 200})
    assert odd.status_code == 404
    assert odd.headers["x-request-id"] == "a_b_c" + "x" * 123  # a plain token, 128 at most
    assert client.get("/health").headers["x-request-id"]
    stream = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert stream.status_code == 200 and stream.headers["x-request-id"]


def test_refusals_before_the_app_carry_it_too(keyed_client):
    refused = keyed_client.post("/v1/completions", json=COMPLETION, headers={"X-Request-ID": "k1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "k1"


@pytest.mark.parametrize(
    ("path", "body", "message_of"),
    [
        ("/v1/completions", COMPLETION, lambda b: b["error"]["message"]),
        ("/infer", {"inputs": "hi"}, lambda b: b["error"]),
        ("/serving-endpoints/demo/invocations", {"prompt": "hi"}, lambda b: b["message"]),
        ("/v2/models/demo/generate", {"text_input": "hi"}, lambda b: b["error"]),
    ],
)
def test_an_unexpected_failure_names_the_id_not_the_internals(
    client, monkeypatch, caplog, path, body, message_of
):
    async def broken(req):
        raise RuntimeError(f"cannot open {SECRET}")

    monkeypatch.setattr(client.app.state.pipeline, "tokenize", broken)
    with caplog.at_level(logging.ERROR, logger="serve_app.ingress.request_ids"):
        response = client.post(path, json=body, headers={"X-Request-ID": "trace-7"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-7"
    message = message_of(response.json())
    assert "internal error" in message and "request id trace-7" in message
    assert SECRET not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if "trace-7" in r.getMessage()]
    assert logged and SECRET in logged[0].exc_text


def test_a_failure_mid_stream_ends_it_with_the_id(client, monkeypatch, caplog):
    backend = client.app.state.pipeline.backend
    real = backend.generate

    async def breaks_after_one(model, req):
        async for chunk in real(model, req):
            yield chunk
            raise RuntimeError(f"lost {SECRET}")

    monkeypatch.setattr(backend, "generate", breaks_after_one)
    body = {**COMPLETION, "stream": True, "max_tokens": 16}
    with caplog.at_level(logging.ERROR, logger="serve_app.ingress.request_ids"):
        response = client.post("/v1/completions", json=body, headers={"X-Request-ID": "s-1"})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "request id s-1" in error["message"] and SECRET not in response.text
    assert any(SECRET in (r.exc_text or "") for r in caplog.records)


@pytest.mark.parametrize("stream", [False, True])
def test_one_line_per_request_ties_the_clients_id_to_the_engines(client, caplog, stream):
    body = {"model": "demo", "prompt": "hi", "max_tokens": 3, "stream": stream}
    with caplog.at_level(logging.INFO, logger="serve_app.ingress.pipeline"):
        reply = client.post("/v1/completions", json=body, headers={"X-Request-ID": "trace-me-7"})
    assert reply.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "serve_app.ingress.pipeline"]
    (line,) = [m for m in lines if "trace-me-7" in m]
    engine_id = re.search(r"engine request (\S+),", line).group(1)
    assert engine_id.startswith("cmpl-") and "success" in line and "3 output tokens" in line
    if not stream:
        assert reply.json()["id"] == engine_id  # the id the client sees in the body too
