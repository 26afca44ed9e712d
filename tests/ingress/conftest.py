"""The app over plain objects in process (no Ray): one tokenizer pool and one model replica on
demo-tiny, shared by every route test of the session."""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from serve_app.config import load_config

ROUTE_TEST_CONFIG = {
    "BackendConfig": {
        "ModelDeployConfig": {
            "maxSeqLen": 512,
            "maxInputTokenLen": 256,
            "ModelConfig": [{"modelName": "demo", "modelWeightPath": "demo-tiny"}],
        },
        "ScheduleConfig": {
            "maxIterTimes": 64,
            "maxPrefillTokens": 512,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 256,
        },
    },
    "EmbeddingConfig": [{"endpointName": "minilm", "modelWeightPath": "all-minilm-l6-v2"}],
}


@pytest.fixture(scope="session")
def route_app():
    app, replica = local_app(ROUTE_TEST_CONFIG)
    app.state.replica = replica  # tests read engine stats (KV blocks) through it
    yield app
    replica.shutdown()


def local_app(args: dict):
    """(the FastAPI app over plain objects, its model replica) for these application args."""
    from serve_app.ingress.app import create_app
    from serve_app.ingress.backend import LocalBackend
    from serve_app.replica.embedding_replica import EmbeddingReplica
    from serve_app.replica.model_replica import ModelReplica
    from serve_app.tokenizer.pool import TokenizerPool

    config = load_config(args)
    replica = ModelReplica(config)
    embedding = {name: EmbeddingReplica(config, i) for i, name in enumerate(config.embedding_names)}
    backend = LocalBackend(TokenizerPool(config), {"demo": replica}, embedding=embedding)
    return create_app(config, backend), replica


@pytest.fixture(scope="session")
def client(route_app):
    with TestClient(route_app) as c:
        yield c


@pytest.fixture
def kv_idle(client):
    """A callable: True once all KV blocks are free and nothing runs (nothing leaked)."""
    import time

    def check(timeout_s: float = 3.0) -> bool:
        replica = client.app.state.replica
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = client.portal.call(replica.stats)
            idle = not stats["num_running"] and not stats["num_waiting"]
            if idle and stats["num_free_blocks"] == stats["num_blocks"]:
                return True
            time.sleep(0.02)
        return False

    return check


@contextlib.contextmanager
def served(app):
    """The app on a real socket on 127.0.0.1 (uvicorn in a thread): its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def live_url():
    """The app (its own replicas) served over a real socket, for clients that do not speak
    httpx (the databricks-sdk uses requests)."""
    app, replica = local_app(ROUTE_TEST_CONFIG)
    with served(app) as url:
        yield url
    replica.shutdown()


API_KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed_app():
    """The app with API keys on (its own replicas)."""
    import copy

    args = copy.deepcopy(ROUTE_TEST_CONFIG)
    args["ServerConfig"] = {"apiKeys": list(API_KEYS)}
    app, replica = local_app(args)
    yield app
    replica.shutdown()


@pytest.fixture(scope="module")
def keyed_client(keyed_app):
    with TestClient(keyed_app) as client:
        yield client


@pytest.fixture(scope="session")
def serve_live():
    """`served` for tests: a context manager putting an app on a real socket."""
    return served
