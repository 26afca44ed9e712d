"""Request bodies: the size limit (declared or counted for chunked uploads) and JSON bodies sent
with another content type, on the real app and on the middleware alone."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from serve_app.ingress.request_body import RequestBody

LIMIT_MB = 40  # ServerConfig.maxRequestLength's default, which the route tests' config keeps


def _chunks(total: int, size: int = 1 << 20):
    sent = 0
    while sent < total:
        part = min(size, total - sent)
        sent += part
        yield b" " * part


@pytest.mark.parametrize(
    "path, shape",
    [("/v1/completions", "openai"), ("/infer", "mindie"), ("/v2/models/demo/generate", "triton")],
)
def test_declared_body_over_the_limit_is_413_in_the_family_envelope(client, path, shape):
    body = b" " * (LIMIT_MB * 1024 * 1024 + 1)
    response = client.post(path, content=body)
    assert response.status_code == 413
    error = response.json()["error"]
    message = error["message"] if shape == "openai" else error
    assert "ServerConfig.maxRequestLength" in message and f"{LIMIT_MB} MB" in message


def test_chunked_body_over_the_limit_is_413(client):
    """No Content-Length: the bytes are counted as they arrive."""
    response = client.post("/v1/completions", content=_chunks(LIMIT_MB * 1024 * 1024 + 10))
    assert response.status_code == 413
    assert "maxRequestLength" in response.json()["error"]["message"]


def test_chunked_body_within_the_limit_is_served(client):
    body = b'{"model": "demo", "prompt": "hi", "max_tokens": 2}'
    response = client.post("/v1/completions", content=iter([body[:10], body[10:]]))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_form_encoded_json_is_read_as_json(client):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded."""
    response = client.post(
        "/v1/completions",
        content=b'{"model": "demo", "prompt": "hi", "max_tokens": 1}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200, response.text


# -- the middleware alone, with a limit of 8 bytes ---------------------------------------------


@pytest.fixture(scope="module")
def echo():
    app = FastAPI()

    @app.post("/v1/echo")
    async def post(request: Request):
        return {"body": (await request.body()).decode(), "type": request.headers["content-type"]}

    @app.get("/v1/echo")
    async def get():
        return {"ok": True}

    app.add_middleware(RequestBody, max_bytes=8, max_mb=1)
    with TestClient(app) as c:
        yield c


def test_a_body_at_the_limit_reaches_the_route_as_json(echo):
    response = echo.post("/v1/echo", content=b"12345678", headers={"content-type": "text/plain"})
    assert response.json() == {"body": "12345678", "type": "application/json"}


def test_a_json_content_type_is_kept(echo):
    kind = "application/json; charset=utf-8"
    response = echo.post("/v1/echo", content=b"{}", headers={"content-type": kind})
    assert response.json()["type"] == kind


@pytest.mark.parametrize("content", [b"123456789", iter([b"1234", b"5678", b"9"])])
def test_one_byte_over_is_refused(echo, content):
    response = echo.post("/v1/echo", content=content)
    assert response.status_code == 413
    assert "at most 1 MB (ServerConfig.maxRequestLength)" in response.json()["error"]["message"]


def test_other_methods_pass_through(echo):
    assert echo.get("/v1/echo").json() == {"ok": True}
