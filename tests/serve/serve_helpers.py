"""What the serve test modules share: application args and deploying them (not tests)."""

from __future__ import annotations

import copy
import time

import httpx
import pytest

EMBEDDING_ENDPOINT = "all-minilm-l6-v2"
SERVE_TEST_ARGS = {
    "BackendConfig": {
        "tokenizerProcessNumber": 1,
        "ModelDeployConfig": {
            "maxSeqLen": 512,
            "maxInputTokenLen": 256,
            # the engine's step loop in a process of its own, as deployments.yaml has it
            "ModelConfig": [
                {"modelName": "demo", "modelWeightPath": "demo-tiny", "engineProcess": True}
            ],
        },
        "ScheduleConfig": {
            "maxIterTimes": 64,
            "maxPrefillTokens": 512,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 256,
        },
    },
    # the built-in all-MiniLM-L6-v2 as an embedding endpoint (its own CPU deployment), so the
    # embedding routes can be tested over Ray; readiness waits for it too
    "EmbeddingConfig": [
        {"endpointName": EMBEDDING_ENDPOINT, "modelWeightPath": "all-minilm-l6-v2"}
    ],
}

PD_MAX_ITER = 64
PD_ARGS = copy.deepcopy(SERVE_TEST_ARGS)
PD_ARGS["ServerConfig"] = {"inferMode": "dmi"}
PD_ARGS["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["dtype"] = "float32"


def deploy(cluster, args: dict) -> str:
    """Deploys the app with these args (replacing any), returns its base URL once ready."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name="serve_app", route_prefix="/")
    url = f"http://127.0.0.1:{cluster.port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the app did not become ready in 120 s")
