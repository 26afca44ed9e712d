"""One Ray cluster and Serve instance for the whole serve test session; one app per module.

The cluster is built on this machine with `ray.cluster_utils.Cluster`: a head node without `NPU`
(the ingress and the tokenizer pool need none) and two workers advertising `NPU: 1` each, so
model replicas must land on workers and see ASCEND_RT_VISIBLE_DEVICES there (the model runs on
CPU). test_serve_app.py deploys the colocated app, test_pd.py the PD one (one replica per worker).
"""

from __future__ import annotations

import functools
import socket

import httpx
import pytest
from serve_helpers import kv_idle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def cluster():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.__main__ import RAY_BACKGROUND_ENV

    # Ray's background work as `make serve` sets it, which also starts Ray's workers (every
    # replica) at normal priority: at Ray's default (nice 15) the replicas starting up here yield
    # the CPU to the other xdist worker's tests (nice 10), which are not waited for.
    patch = pytest.MonkeyPatch()
    for name, value in RAY_BACKGROUND_ENV.items():
        patch.setenv(name, value)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    # Ray's own traffic stays on this machine's address (forcing 127.0.0.1 on the nodes made
    # the driver look for the GCS elsewhere); the HTTP proxy below listens on 127.0.0.1 only.
    workers = [cluster.add_node(num_cpus=2, resources={"NPU": 1}) for _ in range(2)]
    ray.init(address=cluster.address, logging_level="WARNING")
    cluster.npu_node_ids = {w.node_id for w in workers}
    cluster.port = _free_port()
    # One proxy: all "nodes" share this machine, so a proxy per node would fight over the port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": cluster.port})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    patch.undo()


@pytest.fixture(scope="module")
def http(server):  # each module's `server` fixture: the base URL of the app it deployed
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


@pytest.fixture
def kv_idle_http(http):
    """A callable: True once the replicas report no running request and no used KV block."""
    return functools.partial(kv_idle, str(http.base_url).rstrip("/"))
