"""The app over plain objects in process (no Ray): one tokenizer pool and one model replica on
demo-tiny, shared by every route test of the session."""

from __future__ import annotations

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
    }
}


@pytest.fixture(scope="session")
def route_app():
    from serve_app.ingress.app import create_app
    from serve_app.ingress.backend import LocalBackend
    from serve_app.replica.model_replica import ModelReplica
    from serve_app.tokenizer.pool import TokenizerPool

    config = load_config(ROUTE_TEST_CONFIG)
    replica = ModelReplica(config)
    app = create_app(config, LocalBackend(TokenizerPool(config), {"demo": replica}))
    app.state.replica = replica  # tests read engine stats (KV blocks) through it
    yield app
    replica.shutdown()


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
