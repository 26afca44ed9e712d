"""More than one of everything over Ray: two ingress replicas, two models (ModelConfig entries)
with two to three autoscaled replicas each, two tokenizer pool replicas. Requests to both models
are served by both of each model's replicas, a stopInfer reaches its request whichever ingress
replica it lands on (the shared StopRegistry), and a burst of load scales a model out while
its end scales it back in without cutting a stream. Slow."""

from __future__ import annotations

import copy
import json
import re
import threading
import time

import httpx
import pytest
from serve_helpers import LONG_MAX_TOKENS, SERVE_TEST_ARGS, deploy, engine_processes, kv_idle

from serve_app.ingress.replica_stats import serve_replicas

MODELS = ("demo", "demo-b")
ARGS = copy.deepcopy(SERVE_TEST_ARGS)
ARGS.pop("EmbeddingConfig")
ARGS["BackendConfig"]["tokenizerProcessNumber"] = 2
ARGS["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [
    # on CPU: four model replicas would not fit the test cluster's two NPU nodes
    {"modelName": name, "modelWeightPath": "demo-tiny", "engineProcess": True, "device": "cpu"}
    for name in MODELS
]
# Each model's replicas autoscale between two and three, a third once the replicas hold more than
# 8 requests each on average (the load of the first tests stays below); a replica stopped on a
# scale-down drains its streams for up to 120 s
SCALING = {
    "min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 8, "upscale_delay_s": 0,
    "downscale_delay_s": 10, "look_back_period_s": 1,
}  # fmt: skip
# The ingress replicas' routers trust a replica's last known queue length for 1 s (Ray Serve's
# default, 10 s: a replica busy at the burst's end would look busy, and get no stream, for that
# long after it is idle); their handles report the load to the autoscaler every 0.5 s (the app
# keeps that below look_back_period_s)
INGRESS_ROUTING_ENV = {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "1"}
ARGS["Deployments"] = {
    "Ingress": {"num_replicas": 2,
                "ray_actor_options": {"runtime_env": {"env_vars": INGRESS_ROUTING_ENV}}},
    "ModelReplica": {"autoscaling_config": SCALING, "graceful_shutdown_timeout_s": 120,
                     "graceful_shutdown_wait_loop_s": 0.5},
}  # fmt: skip
# a greedy request of LONG_MAX_TOKENS runs for seconds on any machine: a stop sent after its first
# event ends it long before its end
ARGS["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 4096
ARGS["BackendConfig"]["ScheduleConfig"].update(maxIterTimes=LONG_MAX_TOKENS, kvCacheBlocks=1024)


@pytest.fixture(scope="module")
def app(cluster):
    from ray import serve

    yield deploy(cluster, ARGS)
    serve.delete("serve_app")


def _engine_cpu_seconds(deployment: str | None = None) -> dict[int, float]:
    """CPU seconds of each model replica's engine process (of one deployment), by pid."""
    found = {}
    for proc in engine_processes():
        title = " ".join(proc.parent().cmdline())  # the replica: ray::ServeReplica:<app>:<name>
        if deployment is None or re.search(rf":{re.escape(deployment)}(\.|\s|$)", title):
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


def _stop_infer(app: str, request_id: str) -> httpx.Response:
    return httpx.post(f"{app}/v2/models/demo/stopInfer", json={"id": request_id}, timeout=30)


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
                stop = _stop_infer(app, request_id)
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


def _replica_states(deployment: str) -> dict[str, int]:
    from ray import serve

    status = serve.status().applications["serve_app"].deployments[deployment]
    return {getattr(k, "value", str(k)): n for k, n in status.replica_states.items()}


def _stream(app: str, request_id: str, got: dict) -> None:
    """A Triton stream with this id that only a stopInfer ends (LONG_MAX_TOKENS: it runs for
    minutes on any machine); got[request_id]: its data events, in order, as they come."""
    body = {"id": request_id, "text_input": request_id,
            "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "temperature": 0,
                           "details": True}}  # fmt: skip
    events: list = []
    got[request_id] = events
    with httpx.stream("POST", f"{app}/v2/models/demo/generate_stream", json=body,
                      timeout=300) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))


def test_a_burst_scales_a_model_out_and_its_end_scales_it_in_without_cutting_a_stream(app):
    """Autoscaling live: a burst of requests on "demo" (above 8 per replica) starts a third
    replica; streams then run on all three (each replica's engine busy once the burst is over);
    Serve scales back to two while they run, and the replica it stops drains its streams
    (graceful_shutdown_timeout_s) instead of cutting them: every stream runs until the test
    stops it (stopInfer, not a length: the verdict does not depend on the machine's speed) and
    ends whole, and the survivors hold no KV."""
    deployment = "ModelReplica-demo"
    assert _replica_states(deployment) == {"RUNNING": 2}

    # the burst: 20 requests at once (10 a replica), each running until its stopInfer (a
    # request that ends and is sent again would cost the CPU its start needs)
    def burst(request_id: str) -> None:
        body = {"id": request_id, "text_input": request_id,
                "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "temperature": 0}}  # fmt: skip
        httpx.post(f"{app}/v2/models/demo/generate", json=body, timeout=300)

    burst_ids = [f"burst-{i}" for i in range(20)]
    stopped = []
    burst_threads = [threading.Thread(target=burst, args=(i,)) for i in burst_ids]
    streams: dict = {}
    stream_threads = []
    try:
        for thread in burst_threads:
            thread.start()
        deadline = time.monotonic() + 180
        while _replica_states(deployment).get("RUNNING", 0) < 3:
            assert time.monotonic() < deadline, f"no third replica: {_replica_states(deployment)}"
            time.sleep(0.5)
        time.sleep(2)  # the ingress replicas' routers learn of the third
    finally:
        for request_id in burst_ids:
            stopped.append(_stop_infer(app, request_id).status_code)
        for thread in burst_threads:
            thread.join()
    assert stopped == [200] * 20, stopped  # every burst request was still running
    # the burst is over, and Serve waits out downscale_delay_s before it scales in: streams now,
    # once the routers' queue lengths of the burst are stale, one after the other (each once the
    # one before has its first event), so the routers (the less loaded of two replicas) spread
    # them over all three
    time.sleep(1.5)
    for i in range(9):
        thread = threading.Thread(target=_stream, args=(app, f"long-{i}", streams))
        thread.start()
        stream_threads.append(thread)
        while not streams.get(f"long-{i}"):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
    # the burst's requests are over: the replica Serve stops next is running streams
    before = _engine_cpu_seconds(deployment)
    time.sleep(1.0)
    after = _engine_cpu_seconds(deployment)
    assert len([p for p in before if after.get(p, 0) - before[p] > 0.05]) == 3, (before, after)
    # Serve scales in while the streams run: one replica stops and drains its streams
    # (graceful_shutdown_timeout_s); they are stopped once it has drained them for 2 s
    draining_s, last = 0.0, time.monotonic()
    deadline = last + 120
    while draining_s <= 2:
        states, now = _replica_states(deployment), time.monotonic()
        if states.get("STOPPING") and states.get("RUNNING") == 2:
            draining_s += now - last
        last = now
        assert all(t.is_alive() for t in stream_threads), "a stream ended before its stop"
        assert now < deadline, f"no replica drained the streams: {states}"
        time.sleep(0.2)
    for request_id in streams:
        stop = _stop_infer(app, request_id)
        assert stop.status_code == 200, (request_id, stop.text)
    for thread in stream_threads:
        thread.join(60)
    assert not any(t.is_alive() for t in stream_threads), "a stream did not end after its stop"
    # every stream, the draining replica's among them, ran until its stop and ended whole (a cut
    # stream ends with an error event, or without its final event)
    for request_id, events in streams.items():
        details = events[-1].get("details") or {}
        assert details.get("finish_reason") == "stop_sequence", (request_id, events[-1])
        assert details["generated_tokens"] >= len(events) - 1 > 0, (request_id, details)
        assert all("error" not in e for e in events), request_id
    deadline = time.monotonic() + 60
    while _replica_states(deployment) != {"RUNNING": 2}:
        assert time.monotonic() < deadline, _replica_states(deployment)
        time.sleep(0.5)
    survivors = _idle_survivors(deployment)
    assert len(survivors) == 2, "a surviving replica holds requests or KV blocks"
    # the ids the replicas report are their Ray Serve replica ids: what the ingress checks
    # against Ray's list of replicas to stop counting one that left
    running = serve_replicas()[f"serve_app#{deployment}"]
    assert survivors == running, (survivors, running)
    assert kv_idle(app, 30), "/metrics still counts requests or KV blocks"


def _idle_survivors(deployment: str, timeout_s: float = 30) -> set[str]:
    """The ids of the deployment's replicas once each of the two running ones reports no
    running request and no KV block in use (their own engine stats, each replica reached
    through the handle in turn); empty if they do not within timeout_s."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name="serve_app")
    latest: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = handle.stats.remote().result()
        latest[stats["replica_id"]] = stats
        if len(latest) >= 2 and all(
            s["num_running"] == 0 and s["kv_usage"] == 0 for s in latest.values()
        ):
            return set(latest)
        time.sleep(0.1)
    return set()
