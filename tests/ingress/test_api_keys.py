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
