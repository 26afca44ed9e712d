"""What the serve test modules share: application args and deploying them (not tests)."""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import pytest

from bench import overload
from tests.processes import started_by_this_run

EMBEDDING_ENDPOINT = "all-minilm-l6-v2"
SERVE_TEST_ARGS = {
    # a stream answers once its first token or its error exists, however loaded the machine
    "ServerConfig": {"streamKeepAlive": 0},
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

PD_ARGS = copy.deepcopy(SERVE_TEST_ARGS)
PD_ARGS.pop("EmbeddingConfig")  # no PD test needs it: one replica less to start per deploy
PD_ARGS["ServerConfig"] = {**PD_ARGS["ServerConfig"], "inferMode": "dmi"}
PD_ARGS["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["dtype"] = "float32"


# The args of the app deploy() last deployed and still runs: a module that asks for the same
# app again (test_faults.py after test_serve_app.py) gets it without a second deploy.
_deployed: dict[str, str] = {}


def deploy(cluster, args: dict) -> str:
    """Deploys the app with these args (replacing any other), returns its base URL once ready."""
    from ray import serve

    from serve_app.app import build_app

    url = f"http://127.0.0.1:{cluster.port}"
    key = json.dumps(args, sort_keys=True)
    if _deployed.get("args") == key and url not in _NOT_BACK and _ready(url):
        return url
    _deployed.clear()
    serve.run(build_app(args), name="serve_app", route_prefix="/")
    _NOT_BACK.discard(url)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _ready(url):
            _deployed["args"] = key
            return url
        time.sleep(0.5)
    pytest.fail("the app did not become ready in 120 s")


def forget_deployed() -> None:
    """For a test that deploys or deletes the app by itself: deploy() deploys afresh next."""
    _deployed.clear()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# -- abort tests: limits long enough that only an abort frees a request early -----------------

# A greedy request of this many tokens (greedy: the demo model never draws EOS, so nothing but
# its length ends it) generates for many seconds even on a fast machine, so a test that waits
# for the KV pool to go idle cannot pass by the request simply finishing inside the wait.
LONG_MAX_TOKENS = 3584
LONG_KV_BLOCKS = 2048  # several such requests at once, should one not be aborted; also tells
# the long app's replicas from those of an app deployed before it


def _long(args: dict) -> dict:
    args = copy.deepcopy(args)
    args["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 4096  # max_position_embeddings
    schedule = args["BackendConfig"]["ScheduleConfig"]
    schedule["maxIterTimes"] = LONG_MAX_TOKENS
    schedule["kvCacheBlocks"] = LONG_KV_BLOCKS
    return args


# The colocated app of test_serve_app.py, kept for test_faults.py (which breaks it, last): two
# tokenizer replicas (one is killed), and Serve notices a replica whose engine died at its next
# health check, every second here rather than the default 10 s.
SERVE_LONG_ARGS = _long(SERVE_TEST_ARGS)
SERVE_LONG_ARGS["BackendConfig"]["tokenizerProcessNumber"] = 2
SERVE_LONG_ARGS["Deployments"] = {"ModelReplica": {"health_check_period_s": 1}}
PD_LONG_ARGS = _long(PD_ARGS)

# One app for test_real_model.py and test_world_size.py (one deploy for both, in that order:
# tests/conftest.py RAY_ORDER): the built-in SmolLM2 (first: a MindIE request without a model
# gets it) and the same split over three ranks (its 9 query and 3 KV heads), the demo split over
# two ranks ("demo") and the same weights on one ("one"), all float32 so that log-probabilities
# compare closely; each model's engine in a process of its own, as deployments.yaml has it.
# (SmolLM2 as deployments.yaml serves it, in bfloat16, is test_cli.py's `make serve` test.)
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_SPLIT = "smollm2-over-three-ranks"
MODELS_ARGS = copy.deepcopy(SERVE_LONG_ARGS)
MODELS_ARGS.pop("EmbeddingConfig")  # not tested there: one replica less to start
MODELS_ARGS["BackendConfig"]["tokenizerProcessNumber"] = 1
MODELS_ARGS["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [
    *({"modelName": name, "modelWeightPath": path, "engineProcess": True, "device": "cpu",
       "dtype": "float32", "worldSize": world}
      for name, path, world in ((SMOLLM2, SMOLLM2, 1), (SMOLLM2_SPLIT, SMOLLM2, 3),
                                ("demo", "demo-tiny", 2), ("one", "demo-tiny", 1))),
]  # fmt: skip


def seconds_per_token(url: str, num_tokens: int = 128) -> float:
    """What an unaborted greedy request costs per token on the app at url: a /infer stream of
    num_tokens, timed from its sending to its last token, per token (the reference the abort
    tests compare their wait with). Not from its first token: a client or ingress held off the
    CPU meanwhile receives the tokens in one burst, which once measured ~0 s per token."""
    import json

    body = {"inputs": "tell me a long story", "stream": True,
            "parameters": {"max_new_tokens": num_tokens, "do_sample": False}}  # fmt: skip
    times = []
    sent = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/infer", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert "error" not in json.loads(line[6:]), line
                    times.append(time.monotonic())
    assert len(times) == num_tokens
    return (times[-1] - sent) / num_tokens


def kv_idle(url: str, timeout_s: float = 5.0) -> bool:
    """True once the app's /metrics shows, for every model, no running request and no used KV
    block (polled)."""
    names = ("num_requests_running{", "npu_cache_usage_perc{")
    deadline = time.monotonic() + timeout_s
    while True:
        values: dict[str, list[float]] = {}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith(names):
                values.setdefault(line.split("{")[0], []).append(float(line.rsplit(" ", 1)[1]))
        if len(values) == len(names) and not any(any(v) for v in values.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def assert_freed_early(idle, hung_up_at: float, tokens_left: int, s_per_token: float) -> None:
    """Asserts that the KV pool went idle (idle(timeout_s) -> bool, polled with a generous
    deadline) well before a request with tokens_left still to generate could have ended by
    itself: in less than half the time those tokens take unaborted (s_per_token, measured).
    Without an abort the pool is still busy when the wait ends, or, on a machine fast enough
    to finish the request inside the wait, went idle only as late as the request's end."""
    assert idle(10.0), "KV blocks still held 10 s after the request should have been aborted"
    took = time.monotonic() - hung_up_at
    natural = tokens_left * s_per_token
    assert took < natural / 2, (
        f"idle {took:.1f} s after the abort, but the request would have ended by itself in "
        f"~{natural:.1f} s: this proves no abort (make the request longer)"
    )


def stop_infer_mid_stream(url: str, http, request_id: str, body: dict, after_events: int):
    """Stream `body` (carrying `request_id`) from MindIE's generate_stream on a thread, call
    stopInfer once `after_events` events have arrived, wait for the stream to end; the events
    and the time of the stop. Fails if the stream never got that far or did not end."""
    result, reached = {"events": []}, threading.Event()

    def run():
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v2/models/demo/generate_stream", json=body) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(json.loads(line[len("data: ") :]))
                        if len(result["events"]) >= after_events:
                            reached.set()
        reached.set()  # ended before that: let the caller see it

    thread = threading.Thread(target=run)
    thread.start()
    assert reached.wait(60), f"not {after_events} events within 60 s"
    assert result["status"] == 200 and len(result["events"]) >= after_events, result
    stopped = http.post("/v2/models/demo/stopInfer", json={"id": request_id})
    stopped_at = time.monotonic()
    assert stopped.status_code == 200 and stopped.json() == {"id": request_id}
    thread.join(60)
    assert not thread.is_alive(), "the stream did not end after stopInfer"
    assert all("error" not in e for e in result["events"])
    return result["events"], stopped_at


# -- faults: a replica killed under a stream ----------------------------------------------------

FAULT_STREAM = {"model": "demo", "prompt": "tell me a long story", "max_tokens": 4000,
                "ignore_eos": True, "stream": True}  # fmt: skip
ERROR_WITHIN_S = 5.0  # a stream whose replica died ends with an error event this soon
BACK_WITHIN_S = 120.0  # Serve has replaced what died and the app serves again this soon


def actors(deployment: str) -> list[dict]:
    import ray

    return [
        a for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"#{deployment}#" in a["name"]
    ]  # fmt: skip


def kill(actor: dict) -> None:
    import ray

    ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)


def stream_until_fault(
    url: str, fault, after: int = 1, body: dict = FAULT_STREAM
) -> tuple[list[dict], float]:
    """A long completion stream (body); after its `after`-th event `fault()` runs. Returns the
    events and the seconds from the fault to the stream's end."""
    events: list[dict] = []
    faulted_at = None
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if faulted_at is None and len(events) == after:
                    fault()
                    faulted_at = time.monotonic()
    assert faulted_at is not None
    return events, time.monotonic() - faulted_at


# Apps that did not come back after a fault: the tests after the failing one fail at once
# instead of each waiting BACK_WITHIN_S again (a new deploy of the URL clears it).
_NOT_BACK: set[str] = set()


def serves_again(url: str) -> None:
    """Ready again and a request succeeds, within BACK_WITHIN_S."""
    if url in _NOT_BACK:
        pytest.fail("the app did not serve again after an earlier fault in this module")
    deadline = time.monotonic() + BACK_WITHIN_S
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
            if ready and httpx.post(f"{url}/v1/completions", json=body, timeout=30).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    _NOT_BACK.add(url)
    pytest.fail(f"the app did not serve again within {BACK_WITHIN_S:.0f} s")


def engine_processes() -> list:
    """The engine processes of the test cluster's model replicas (psutil.Process): not those of
    the CLI tests' own apps, which another xdist worker may be running meanwhile."""
    ours = started_by_this_run()
    return [proc for proc in overload.engine_processes() if proc.pid in ours]


def replica_rss_mb() -> dict[str, float]:
    """Resident memory (MB) of the test cluster's replicas and engine processes, by role."""
    return overload.replica_rss_mb(started_by_this_run())
