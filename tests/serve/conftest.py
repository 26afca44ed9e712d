"""One Ray cluster and one running app for the whole serve test session.

The cluster is built on this machine with `ray.cluster_utils.Cluster`: a head node without `NPU`
(the ingress and the tokenizer pool need none) and a worker advertising `NPU: 1`, so the model
replica must land on the worker and see ASCEND_RT_VISIBLE_DEVICES there (the model runs on CPU).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

SERVE_TEST_ARGS = {
    "BackendConfig": {
        "tokenizerProcessNumber": 1,
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
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    # Ray's own traffic stays on this machine's address (forcing 127.0.0.1 on the nodes made
    # the driver look for the GCS elsewhere); the HTTP proxy below listens on 127.0.0.1 only.
    worker = cluster.add_node(num_cpus=2, resources={"NPU": 1})
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.npu_node_id = worker.node_id
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def server(cluster):
    """Base URL of the app, ready (every model replica loaded)."""
    from ray import serve

    from serve_app.app import build_app

    port = _free_port()
    # One proxy: both "nodes" share 127.0.0.1, so a proxy per node would fight over the port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(SERVE_TEST_ARGS), name="serve_app", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail("the app did not become ready in 120 s")
    yield url
    serve.shutdown()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture
def kv_idle_http(http):
    """A callable: True once the replica reports no running request and no used KV block."""

    def check(timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = http.get("/metrics").text
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(("num_requests_running{", "npu_cache_usage_perc{"))
            }
            if values.get("num_requests_running") == 0 and values.get("npu_cache_usage_perc") == 0:
                return True
            time.sleep(0.1)
        return False

    return check
