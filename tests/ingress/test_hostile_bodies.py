"""Hostile bodies on every POST route: invalid UTF-8, JSON nested a hundred thousand deep,
numbers JSON cannot hold, and slow uploads (slow-loris). Each is a 4xx in the route's family
shape, never a 5xx, and a client still sending its body holds no place a request could use."""

from __future__ import annotations

import copy
import socket
import time

import httpx
import pytest

from tests.ingress.conftest import ROUTE_TEST_CONFIG, in_family_envelope, local_app

POST_ROUTES = [
    "/infer", "/infer_token", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
    "/v1/responses", "/v1/tokenizer", "/v2/models/demo/generate",
    "/v2/models/demo/generate_stream", "/v2/models/demo/stopInfer",
    "/serving-endpoints/demo/invocations", "/serving-endpoints/chat/completions",
    "/serving-endpoints/completions", "/serving-endpoints/embeddings",
    "/serving-endpoints/responses",
]  # fmt: skip
BODIES = {
    "invalid_utf8": b'{"inputs": "\xff\xfe\xfd", "prompt": "\xc3\x28", "model": "demo"}',
    "deep_array": b"[" * 100_000,
    "deep_object": b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    "huge_number": b'{"model": "demo", "prompt": "hi", "max_tokens": 1e400, "n": '
    + b"9" * 5000
    + b"}",
    "not_an_object": b'"just a string"',
    "empty": b"",
}


@pytest.mark.parametrize("body", sorted(BODIES))
@pytest.mark.parametrize("path", POST_ROUTES)
def test_a_hostile_body_is_a_client_error_in_the_family_shape(client, path, body):
    response = client.post(path, content=BODIES[body], headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert in_family_envelope(path, response.json()), response.text[:300]


@pytest.fixture(scope="module")
def one_slot_server(serve_live):
    """The app with maxLinkNum 1, on a real socket."""
    args = copy.deepcopy(ROUTE_TEST_CONFIG)
    args["ServerConfig"] = {**args["ServerConfig"], "maxLinkNum": 1}
    app, replica = local_app(args)
    with serve_live(app) as url:
        yield url
    replica.shutdown()


def test_slow_uploads_hold_no_place(one_slot_server):
    """Three clients that announce a body and send it a byte at a time (or not at all) while a
    normal request comes: with one place (maxLinkNum 1) and twice as many in the queue, it is
    served at once. The slow ones are answered when their bodies are whole, or never."""
    host, port = one_slot_server.removeprefix("http://").split(":")
    body = b'{"model": "demo", "prompt": "hi", "max_tokens": 2}'
    slow = []
    for _ in range(3):
        conn = socket.create_connection((host, int(port)))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        conn.sendall(head.encode() + body[:5])
        slow.append(conn)
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{one_slot_server}/v1/completions", content=body, timeout=30,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert response.status_code == 200 and time.monotonic() - started < 10
        # a slow client that finishes its body is then served like any other
        slow[0].sendall(body[5:])
        slow[0].settimeout(30)
        assert slow[0].recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for conn in slow:
            conn.close()
