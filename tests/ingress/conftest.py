"""The app over plain objects in process (no Ray): one tokenizer pool and one model replica on
demo-tiny, shared by every route test of the session."""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from serve_app.config import load_config
from serve_app.protocol.errors import family_for_path
from tests.stepping import Stepping

ROUTE_TEST_CONFIG = {
    # a stream answers once its first token or its error exists, however loaded the machine
    # (its keep-alive comments past streamKeepAlive: tests/ingress/test_sse.py)
    "ServerConfig": {"streamKeepAlive": 0},
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
    return idle_check(client)


def idle_check(client):
    """kv_idle's callable for the app behind any of these test clients."""
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
    args["ServerConfig"] = {**args["ServerConfig"], "apiKeys": list(API_KEYS)}
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


# -- abort tests: an app whose requests run long enough that only an abort frees them early ---

# A request that asks for this many tokens runs this many engine steps unless it is aborted:
# thousands of steps (seconds even on a fast machine), so a test that waits for the KV pool to
# go idle cannot pass by the request simply finishing inside the wait.
LONG_MAX_TOKENS = 4000
LONG_ROUTE_CONFIG = {
    "BackendConfig": {
        "ModelDeployConfig": {
            "maxSeqLen": 4096,  # demo-tiny's max_position_embeddings
            "maxInputTokenLen": 64,
            "ModelConfig": [{"modelName": "demo", "modelWeightPath": "demo-tiny"}],
        },
        "ScheduleConfig": {
            "maxIterTimes": LONG_MAX_TOKENS,
            "maxPrefillTokens": 512,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 2048,  # eight such requests at once, should one not be aborted
        },
    },
}


@pytest.fixture(scope="session")
def long_route_app():
    """The app (its own replica, engine loop on a thread here) with maxIterTimes
    LONG_MAX_TOKENS: for tests of what frees a request early (client gone, stopInfer,
    timeout, stop string)."""
    app, replica = local_app(LONG_ROUTE_CONFIG)
    app.state.replica = replica
    yield app
    replica.shutdown()


@pytest.fixture(scope="session")
def long_client(long_route_app):
    with TestClient(long_route_app) as c:
        yield c


# The long app's engine steps are paced to at least this long each, so that LONG_MAX_TOKENS
# tokens take seconds on any machine: a timeout of a fraction of a second ends a request long
# before its end, and no wait of the tests can see one finish by itself.
LONG_STEP_PACE_S = 0.002


class EngineWatch:
    """Counts and paces the steps of the long app's engine (`tests/stepping.py`) and waits for
    its KV pool to go idle.

    A request of N tokens that is not aborted runs at least N steps (one token per step), so
    `freed_early(N)` (idle, and fewer than N // 10 steps since the watch started) can only
    hold when something ended the request early: a missing abort either still holds its
    blocks when the wait ends or has run its N steps.
    """

    def __init__(self, client, monkeypatch) -> None:
        self.client = client
        self.replica = client.app.state.replica
        engine = self.replica.engine.engine  # the in-process LLMEngine (thread mode)
        assert engine is not None, "the long app's engine must run on a thread in this process"
        self.stepping = Stepping(engine, monkeypatch, pace_s=LONG_STEP_PACE_S)

    @property
    def steps(self) -> int:
        return self.stepping.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.stepping.steps = value

    def stats(self) -> dict:
        return self.client.portal.call(self.replica.stats)

    def idle(self, timeout_s: float = 10.0) -> bool:
        """True once nothing runs or waits and every KV block is free (polled; generous)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if (
                not stats["num_running"]
                and not stats["num_waiting"]
                and stats["num_free_blocks"] == stats["num_blocks"]
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def running(self, timeout_s: float = 30.0) -> bool:
        """True once the engine runs a request and holds KV blocks for it (polled)."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.stats()
            if stats["num_running"] and stats["num_free_blocks"] < stats["num_blocks"]:
                return True
            time.sleep(0.02)
        return False

    def freed_early(self, max_tokens: int = LONG_MAX_TOKENS, timeout_s: float = 10.0) -> None:
        """Asserts that the pool went idle long before a request of max_tokens could have
        ended by itself."""
        assert self.idle(timeout_s), f"KV blocks still held after {timeout_s} s: {self.stats()}"
        assert self.steps < max_tokens // 10, (
            f"the pool went idle only after {self.steps} engine steps: a request of "
            f"{max_tokens} tokens may have simply finished"
        )


@pytest.fixture
def engine_watch(long_client, monkeypatch):
    """An `EngineWatch` on the long app, started idle (a test's request is the only one)."""
    watch = EngineWatch(long_client, monkeypatch)
    assert watch.idle(), f"the long app was busy before the test: {watch.stats()}"
    watch.steps = 0
    return watch


def in_family_envelope(path: str, body) -> bool:
    """Is this error body the envelope of the route's API family?"""
    family = family_for_path(path)
    if family == "mindie":
        return isinstance(body, dict) and {"error", "error_type"} <= body.keys()
    if family == "openai":
        error = body.get("error") if isinstance(body, dict) else None
        return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()
    if family == "databricks":
        return isinstance(body, dict) and {"error_code", "message"} <= body.keys()
    return isinstance(body, dict) and isinstance(body.get("error"), str)
