"""API keys: every route but health and metrics needs a key; refusals in each family's shape."""

from __future__ import annotations

import databricks.sdk
import openai
import pytest
from databricks.sdk.errors import Unauthenticated

from serve_app.config import ConfigError, load_config

KEY = "key-two"
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, shape",
    [
        ("/infer", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, "mindie"),
        ("/v1/chat/completions", CHAT, "openai"),
        ("/v1/embeddings", {"model": "minilm", "input": "hi"}, "openai"),
        ("/v2/models/demo/generate", {"text_input": "hi"}, "triton"),
        ("/serving-endpoints/demo/invocations", {"prompt": "hi"}, "databricks"),
        ("/serving-endpoints/responses", {"model": "demo", "input": "hi"}, "openai"),
    ],
)  # fmt: skip
def test_a_request_without_a_valid_key_is_401_in_its_family_shape(keyed_client, path, body, shape):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer "}):  # fmt: skip
        r = keyed_client.post(path, json=body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()
        if shape == "openai":
            assert error["error"]["type"] == "AuthenticationError"
        elif shape == "databricks":
            assert error["error_code"] == "UNAUTHENTICATED"
        elif shape == "mindie":
            assert error["error_type"] == "Unauthorized"
        assert KEY not in r.text
    r = keyed_client.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text


# The routes that answer without a key: probes and scrapers carry none. Every other route of the
# app's own table must refuse a request without a key.
OPEN_ROUTES = {
    ("GET", "/health"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"),
    ("GET", "/metrics"), ("GET", "/v2/models/{model}/ready"),
    ("GET", "/.well-known/databricks-config"),
}  # fmt: skip
PATH_VALUES = {"model": "demo", "version": "1", "name": "demo"}
BODIES = {  # a valid body per POST route, so that "served" means answered, not refused
    "/infer": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
    "/infer_token": {"input_id": [1, 2], "parameters": {"max_new_tokens": 2}},
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "demo", "prompt": "hi", "max_tokens": 2},
    "/v1/embeddings": {"model": "minilm", "input": "hi"},
    "/v1/responses": {"model": "demo", "input": "hi", "max_output_tokens": 2},
    "/v2/models/{model}/generate": {"text_input": "hi", "max_tokens": 2},
    "/v2/models/{model}/generate_stream": {"text_input": "hi", "max_tokens": 2},
    "/v2/models/{model}/versions/{version}/generate": {"text_input": "hi", "max_tokens": 2},
    "/v2/models/{model}/versions/{version}/generate_stream": {"text_input": "hi", "max_tokens": 2},
    "/v2/models/{model}/stopInfer": {"id": "nobody"},  # served: 404, no request has that id
    "/serving-endpoints/{name}/invocations": {"prompt": "hi", "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/serving-endpoints/chat/completions": {**CHAT},
    "/serving-endpoints/completions": {"model": "demo", "prompt": "hi", "max_tokens": 2},
    "/serving-endpoints/embeddings": {"model": "minilm", "input": "hi"},
    "/serving-endpoints/responses": {"model": "demo", "input": "hi", "max_output_tokens": 2},
}


def _route_table(routes) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, routers included, from its own table."""
    found = []
    for route in routes:
        if hasattr(route, "original_router"):  # FastAPI's included router
            found += _route_table(route.original_router.routes)
            continue
        found += [(m, route.path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return found


def test_every_route_of_the_app_needs_a_key_but_the_open_ones(keyed_client):
    table = _route_table(keyed_client.app.routes)
    assert len(table) > 30 and OPEN_ROUTES <= set(table)  # the table was read whole
    for method, path in table:
        url = path.format(**PATH_VALUES)
        body = BODIES.get(path) if method == "POST" else None
        bare = keyed_client.request(method, url, json=body)
        keyed = keyed_client.request(
            method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        if (method, path) in OPEN_ROUTES:
            assert bare.status_code == 200, (method, path, bare.text)
        else:
            assert bare.status_code == 401, (method, path, bare.status_code)
        served = 404 if path.endswith("/stopInfer") else 200
        assert keyed.status_code == served, (method, path, keyed.status_code, keyed.text)


def test_health_metrics_and_readiness_stay_open(keyed_client):
    for path in ("/health", "/v2/health/live", "/v2/health/ready", "/metrics",
                 "/v2/models/demo/ready", "/.well-known/databricks-config"):  # fmt: skip
        assert keyed_client.get(path).status_code == 200, path
    for path in ("/v1/models", "/api/2.0/serving-endpoints", "/docs", "/nope"):
        assert keyed_client.get(path).status_code == 401, path


def test_official_clients_send_their_key(keyed_client):
    good = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=keyed_client)
    assert good.chat.completions.create(**CHAT).choices[0].message.role == "assistant"
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=keyed_client)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(**CHAT)


def test_the_environment_adds_keys_and_no_key_is_shown(monkeypatch):
    monkeypatch.setenv("SERVE_APP_API_KEYS", " env-key , other ")
    config = load_config({"ServerConfig": {"apiKeys": ["from-config"]}})
    keys = [k.get_secret_value() for k in config.ServerConfig.apiKeys]
    assert keys == ["from-config", "env-key", "other"]
    assert "env-key" not in repr(config) and "from-config" not in str(config.model_dump())
    monkeypatch.setenv("SERVE_APP_API_KEYS", "a b")
    with pytest.raises(ConfigError, match="may not contain spaces"):
        load_config({})
    monkeypatch.delenv("SERVE_APP_API_KEYS")
    with pytest.raises(ConfigError, match="apiKeys"):
        load_config({"ServerConfig": {"apiKeys": ["has,comma"]}})
    assert load_config({}).ServerConfig.apiKeys == ()


def test_the_databricks_sdk_sends_its_token(keyed_app, serve_live):
    with serve_live(keyed_app) as url:
        good = databricks.sdk.WorkspaceClient(host=url, token=KEY)
        assert [e.name for e in good.serving_endpoints.list()] == ["demo", "minilm"]
        bad = databricks.sdk.WorkspaceClient(host=url, token="nope")
        with pytest.raises(Unauthenticated, match="a valid API key is required"):
            list(bad.serving_endpoints.list())
