"""Faults over real HTTP on the Ray cluster: a model replica killed mid-stream, an engine process
killed inside a live replica, a tokenizer pool replica killed, and readiness while a model
replica cannot be placed yet. Each affected client gets an error (event or response) within
seconds, Ray Serve replaces what died, and new requests succeed once it is back. Slow.
"""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
from serve_helpers import (
    BACK_WITHIN_S,
    ERROR_WITHIN_S,
    SERVE_LONG_ARGS,
    actors,
    deploy,
    engine_processes,
    forget_deployed,
    kill,
    serves_again,
    stream_until_fault,
)


@pytest.fixture(scope="module")
def app(cluster):
    """test_serve_app.py's app (SERVE_LONG_ARGS: two tokenizer replicas, a health check every
    second), deployed there before these tests break it."""
    return deploy(cluster, SERVE_LONG_ARGS)


def test_a_model_replica_killed_mid_stream_ends_the_stream_and_is_replaced(app):
    (replica,) = actors("ModelReplica")
    events, ended_s = stream_until_fault(app, lambda: kill(replica))
    assert ended_s < ERROR_WITHIN_S
    error = events[-1]["error"]["message"]
    # the ingress says the replica failed; or the replica itself said first that its engine
    # process exited: Ray kills a worker's child processes as it kills the worker, and the
    # replica may see its engine go in the moment before it goes itself
    assert (
        "a replica serving the request failed" in error and "request id" in error
    ) or "engine process exited" in error, error
    assert "Traceback" not in error
    serves_again(app)
    assert [a["name"] for a in actors("ModelReplica")] != [replica["name"]]  # a new one


def test_an_engine_process_killed_inside_a_live_replica_fails_its_requests_and_is_replaced(app):
    serves_again(app)  # the replica of the test before is up
    (engine,) = engine_processes()
    (replica,) = actors("ModelReplica")
    events, ended_s = stream_until_fault(app, engine.kill)
    assert ended_s < ERROR_WITHIN_S
    assert "engine process exited" in events[-1]["error"]["message"]
    # the replica is alive but its engine is not: its health check fails and Serve replaces it
    serves_again(app)
    deadline = time.monotonic() + BACK_WITHIN_S
    while [a["name"] for a in actors("ModelReplica")] == [replica["name"]]:
        assert time.monotonic() < deadline, "the replica without an engine was not replaced"
        time.sleep(1)


def test_a_tokenizer_replica_killed_leaves_requests_to_the_other(app):
    serves_again(app)
    pool = actors("TokenizerPool")
    assert len(pool) == 2
    kill(pool[0])
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
    started = time.monotonic()
    results = [httpx.post(f"{app}/v1/completions", json=body, timeout=30) for _ in range(6)]
    assert time.monotonic() - started < 30
    # served by the other replica (a call that met the dead one is retried there) or, when no
    # replica can take it, refused at once with 503; never a 500
    assert {r.status_code for r in results} <= {200, 503}, [r.text for r in results]
    assert results[-1].status_code == 200
    serves_again(app)


def test_ready_is_503_while_a_model_replica_cannot_be_placed_then_200(cluster):
    """The model replica asks for a resource no node has yet: the ingress is up and says 503;
    once a node offers it, the replica loads and readiness turns 200."""
    from ray import serve

    from serve_app.app import build_app

    args = copy.deepcopy(SERVE_LONG_ARGS)
    # what readiness needs, no more: no embedding replica, one tokenizer replica, the engine on
    # the model replica's thread (fewer processes to start)
    args.pop("EmbeddingConfig")
    args["BackendConfig"]["tokenizerProcessNumber"] = 1
    args["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["engineProcess"] = False
    args["Deployments"]["ModelReplica"]["ray_actor_options"] = {"resources": {"LATE": 1}}
    # no replica of an earlier app may serve meanwhile (an update keeps the old replica
    # running until the new one is up): the app starts from nothing
    serve.delete("serve_app")
    forget_deployed()
    # serve.run returns once the app runs, which needs the node added below: in a thread
    deploying = threading.Thread(
        target=serve.run, args=(build_app(args),), kwargs={"name": "serve_app"}, daemon=True
    )
    deploying.start()
    url = f"http://127.0.0.1:{cluster.port}"
    node = None
    try:
        deadline = time.monotonic() + BACK_WITHIN_S
        status = None
        # (until the new ingress is up, Ray's proxy answers 503 itself, in plain text)
        while status != (503, "application/json"):
            assert time.monotonic() < deadline, f"the ingress never answered 503 ({status})"
            try:
                response = httpx.get(f"{url}/v2/health/ready", timeout=5)
                status = response.status_code, response.headers.get("content-type")
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert response.json()["error_type"] == "Service Unavailable"
        # a request for the model is refused at once in its family's shape, not queued until
        # the replica can be placed (its own timeout, if any, would have long passed)
        started = time.monotonic()
        body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
        for path, request in (("/v1/completions", body), ("/infer", {"inputs": "hi"})):
            refused = httpx.post(f"{url}{path}", json=request, timeout=60)
            assert refused.status_code == 503, (path, refused.text)
            assert "has no replica ready yet" in refused.text
        assert time.monotonic() - started < 30
        time.sleep(3)  # still unplaceable: still 503, never a premature 200
        # (the readiness check asks Serve's controller, which a loaded machine can keep busy
        # for more than a few seconds while it retries the placement: a generous timeout)
        assert httpx.get(f"{url}/v2/health/ready", timeout=60).status_code == 503
        node = cluster.add_node(num_cpus=1, resources={"NPU": 1, "LATE": 1})
        serves_again(url)
        deploying.join(BACK_WITHIN_S)
    finally:
        serve.delete("serve_app")
        if node is not None:
            cluster.remove_node(node)
