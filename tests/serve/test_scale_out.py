"""More than one of everything over Ray: two ingress replicas, two models (ModelConfig entries)
with two replicas each, two tokenizer pool replicas. Requests to both models are served by both
of each model's replicas, and a stopInfer reaches its request whichever ingress replica it
lands on (the shared StopRegistry). Slow."""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import pytest
from serve_helpers import LONG_MAX_TOKENS, SERVE_TEST_ARGS, deploy, engine_processes

MODELS = ("demo", "demo-b")
ARGS = copy.deepcopy(SERVE_TEST_ARGS)
ARGS.pop("EmbeddingConfig")
ARGS["BackendConfig"]["tokenizerProcessNumber"] = 2
ARGS["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [
    # on CPU: four model replicas would not fit the test cluster's two NPU nodes
    {"modelName": name, "modelWeightPath": "demo-tiny", "engineProcess": True, "device": "cpu"}
    for name in MODELS
]
ARGS["Deployments"] = {"Ingress": {"num_replicas": 2}, "ModelReplica": {"num_replicas": 2}}
# a greedy request of LONG_MAX_TOKENS runs for seconds on any machine: a stop sent after its first
# event ends it long before its end
ARGS["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 4096
ARGS["BackendConfig"]["ScheduleConfig"].update(maxIterTimes=LONG_MAX_TOKENS, kvCacheBlocks=1024)


@pytest.fixture(scope="module")
def app(cluster):
    from ray import serve

    yield deploy(cluster, ARGS)
    serve.delete("serve_app")


def _engine_cpu_seconds() -> dict[int, float]:
    """CPU seconds of each model replica's engine process, by pid."""
    found = {}
    for proc in engine_processes():
        times = proc.cpu_times()
        found[proc.pid] = times.user + times.system
    return found


def test_both_models_are_served_by_both_of_their_replicas(app):
    before = _engine_cpu_seconds()
    assert len(before) == 4  # two models x two replicas, each with its engine process

    def run(model: str, results: list) -> None:
        body = {"model": model, "prompt": "hello", "max_tokens": 64, "ignore_eos": True}
        results.append(httpx.post(f"{app}/v1/completions", json=body, timeout=120))

    results: list = []
    threads = [
        threading.Thread(target=run, args=(model, results)) for model in MODELS for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [200] * 16
    assert {r.json()["model"] for r in results} == set(MODELS)
    after = _engine_cpu_seconds()
    busy = [pid for pid in before if after.get(pid, 0) - before[pid] > 0.05]
    assert len(busy) == 4, (before, after)  # every replica of both models took work


def test_stop_infer_reaches_its_request_from_either_ingress_replica(app):
    """Six streams, one stopInfer each as soon as the stream has started, over Ray's proxy and
    two ingress replicas with the shared StopRegistry deployment. Which replica a call lands on
    is Ray's choice; tests/ingress/test_stops.py sends the stop to the other one on purpose."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert sum("#Ingress#" in n for n in names) == 2
    assert sum("#StopRegistry#" in n for n in names) == 1
    with httpx.Client(base_url=app, timeout=60) as client:
        for i in range(6):
            request_id = f"scale-{i}"
            body = {
                "id": request_id,
                "text_input": "count",
                "parameters": {
                    "max_new_tokens": LONG_MAX_TOKENS,
                    "temperature": 0,
                    "details": True,
                },
            }
            with client.stream("POST", "/v2/models/demo/generate_stream", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["id"] == request_id
                stop = httpx.post(
                    f"{app}/v2/models/demo/stopInfer", json={"id": request_id}, timeout=30
                )
                assert stop.status_code == 200, stop.text
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            final = events[-1]
            # ended by the stop (MindIE reports a stopped request as stop_sequence), early
            assert final["details"]["finish_reason"] == "stop_sequence"
            assert final["details"]["generated_tokens"] < LONG_MAX_TOKENS // 10
        # an id nobody runs is unknown on every replica
        unknown = client.post("/v2/models/demo/stopInfer", json={"id": "nobody"})
        assert unknown.status_code == 404


def test_a_tokenizer_pool_of_two_serves_chat_and_text(app):
    for model in MODELS:
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = httpx.post(f"{app}/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200 and response.json()["model"] == model
    deadline = time.monotonic() + 30
    while httpx.get(f"{app}/v2/health/ready", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
