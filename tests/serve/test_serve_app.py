"""The app under Ray Serve, over real HTTP: placement, every family's documented example, the
openai client, disconnects, stopInfer, readiness, metrics and the OpenAPI docs; last, a minute
of mixed traffic on the same app (bench/soak.py's soak).

The app here has maxIterTimes LONG_MAX_TOKENS (serve_helpers.SERVE_LONG_ARGS), so that what
ends a request early (client gone, stopInfer) is shown to free its KV blocks long before the
request could have ended by itself."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from serve_helpers import (
    LONG_KV_BLOCKS,
    LONG_MAX_TOKENS,
    SERVE_LONG_ARGS,
    assert_freed_early,
    deploy,
    replica_rss_mb,
    seconds_per_token,
    stop_infer_mid_stream,
)


@pytest.fixture(scope="module")
def server(cluster):
    """The colocated app with the long limits, left running for test_faults.py."""
    return deploy(cluster, SERVE_LONG_ARGS)


@pytest.fixture(scope="module")
def s_per_token(server):
    """Seconds per token of an unaborted greedy request on this app (the abort tests' yardstick)."""
    return seconds_per_token(server)


def _replica_stats() -> dict:
    from ray import serve

    handle = serve.get_deployment_handle("ModelReplica", app_name="serve_app")
    return handle.stats.remote().result(timeout_s=30)


def _wait_running(timeout_s: float = 60.0) -> bool:
    """True once this app's model replica runs a request that holds KV blocks (polled; a
    replica of an app deployed before, which this process's handle may still reach for a
    moment, has another pool size)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = _replica_stats()
        if (
            stats["num_blocks"] == LONG_KV_BLOCKS
            and stats["num_running"]
            and stats["num_free_blocks"] < stats["num_blocks"]
        ):
            return True
        time.sleep(0.05)
    return False


def _events(response: httpx.Response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_model_replica_is_pinned_to_the_npu_node(cluster, http):
    from ray import serve

    handle = serve.get_deployment_handle("ModelReplica", app_name="serve_app")
    info = handle.device_info.remote().result(timeout_s=30)
    assert info["node_id"] in cluster.npu_node_ids  # the head advertises no NPU
    assert info["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    # Ray's accounting agrees: of the cluster's two NPUs exactly one is taken, the model
    # replica's; the ingress and the tokenizer pool ask for none (they may run on any node)
    import ray

    assert ray.cluster_resources().get("NPU") == 2
    deadline = time.monotonic() + 30  # the resource view catches up within a few heartbeats
    while ray.available_resources().get("NPU", 0) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("NPU", 0) == 1, ray.available_resources()
    reply = http.post("/infer", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert reply.is_success


def test_ready_health_models_docs(http):
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/v2/models/demo/ready").status_code == 200
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["demo"]
    paths = http.get("/openapi.json").json()["paths"]
    for route in (
        "/infer", "/infer_token", "/v1/chat/completions", "/v1/completions",
        "/v2/models/{model}/generate", "/v2/models/{model}/generate_stream",
        "/v2/models/{model}/stopInfer", "/v1/models", "/metrics", "/v2/health/ready",
    ):  # fmt: skip
        assert route in paths, route
    assert http.get("/docs").status_code == 200


def test_infer_token_documented_example(http, kv_idle_http):
    body = {
        "input_id": [5618, 19678, 701, 9072, 13],
        "stream": False,
        "parameters": {
            "temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20,
            "do_sample": True, "seed": None, "repetition_penalty": 1.03, "details": True,
            "typical_p": 0.5, "watermark": False, "priority": 5, "timeout": 10,
        },
    }  # fmt: skip
    r = http.post("/infer_token", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"generated_text", "details"}
    assert out["details"]["generated_tokens"] == 20 and out["details"]["finish_reason"] == "length"
    with http.stream("POST", "/infer_token", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert len(events) == 20
    assert events[0]["prefill_time"] is not None and events[0]["decode_time"] is None
    assert events[-1]["token"]["text"] is None and "generated_text" in events[-1]
    assert kv_idle_http()


def test_chat_and_completions_with_the_openai_client(server, kv_idle_http):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
            stream=True, seed=7,
        )
        if c.choices
    ]  # fmt: skip
    assert "".join(pieces)
    done = client.completions.create(model="demo", prompt="who are you", max_tokens=5, n=2,
                                     best_of=2, logprobs=2, temperature=1)  # fmt: skip
    assert len(done.choices) == 2 and done.usage.completion_tokens == 10
    streamed = list(
        client.completions.create(model="demo", prompt="who are you", max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt="x", max_tokens=1, top_p=0)
    assert kv_idle_http()


def test_triton_generate_example(http):
    r = http.post(
        "/v2/models/demo/generate",
        json={
            "id": "42",
            "text_input": "client input",
            "parameters": {"stream": False, "temperature": 0},
        },
    )  # fmt: skip
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "42" and out["model_name"] == "demo" and isinstance(out["text_output"], str)
    r = http.post("/v2/models/nope/generate", json={"text_input": "x"})
    assert r.status_code >= 400 and set(r.json()) == {"error"}


def test_client_disconnect_aborts_and_frees_kv(server, kv_idle_http, s_per_token):
    body = {"inputs": "tell me a long story", "stream": True,
            "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "do_sample": False,
                           "details": True}}  # fmt: skip
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/infer", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the first token arrived: hang up
    assert_freed_early(kv_idle_http, time.monotonic(), LONG_MAX_TOKENS - 1, s_per_token)


def test_stop_infer_over_http(server, http, kv_idle_http, s_per_token):
    body = {"id": "stop-me", "text_input": "count",
            "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "temperature": 0,
                           "details": True}}  # fmt: skip
    events, stopped_at = stop_infer_mid_stream(server, http, "stop-me", body, 1)
    details = events[-1]["details"]  # the stream ended early, as stopped
    assert details["finish_reason"] == "stop_sequence"
    assert 1 <= details["generated_tokens"] < LONG_MAX_TOKENS
    left = LONG_MAX_TOKENS - details["generated_tokens"]
    assert_freed_early(kv_idle_http, stopped_at, left, s_per_token)
    assert http.post("/v2/models/demo/stopInfer", json={"id": "stop-me"}).status_code == 404


def _demo_metrics(http) -> dict[str, float]:
    """/metrics' samples labelled model_name="demo" (name -> value; labels beyond it kept in
    the name, e.g. a histogram bucket's le)."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("#") or 'model_name="demo"' not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name, labels = key.split("{", 1)
        rest = ",".join(p for p in labels.rstrip("}").split(",") if p != 'model_name="demo"')
        values[f"{name}{{{rest}}}" if rest else name] = float(value)
    return values


def test_metrics(http, kv_idle_http):
    assert kv_idle_http()
    before = _demo_metrics(http)
    # N streamed requests of known prompt and output lengths (streamed: the ingress sees each
    # token arrive, so the time to first token and per output token are real intervals)
    prompts = [[5618, 19678, 701, 9072, 13], [9707, 11, 1879, 0], list(range(1000, 1012))]
    generated = 0
    for i, ids in enumerate(prompts):
        body = {"input_id": ids, "stream": True,
                "parameters": {"max_new_tokens": 6 + i, "details": True,
                               "do_sample": False}}  # fmt: skip
        with http.stream("POST", "/infer_token", json=body) as r:
            assert r.status_code == 200
            events = _events(r)
        assert events[-1]["details"]["generated_tokens"] == len(events) == 6 + i
        generated += 6 + i
    text = http.get("/metrics").text
    for name in (
        "request_received_total", "request_success_total", "prompt_tokens_total",
        "generation_tokens_total", "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
        "num_requests_running", "num_requests_waiting", "npu_cache_usage_perc",
        "num_preemptions_total",
    ):  # fmt: skip
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert any('model_name="demo"' in line for line in lines), name
    after = _demo_metrics(http)

    def rose(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n = len(prompts)
    assert rose("request_received_total") >= n
    assert rose("request_success_total") >= n
    assert rose("prompt_tokens_total") >= sum(map(len, prompts))
    assert rose("generation_tokens_total") >= generated
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_generation_tokens"):  # fmt: skip
        assert rose(f"{histogram}_count") >= n, histogram
        assert rose(f"{histogram}_sum") > 0, histogram
        # every observation falls in the +Inf bucket, which counts them all
        assert rose(f'{histogram}_bucket{{le="+Inf"}}') == rose(f"{histogram}_count"), histogram
    # the token histograms observe the tokens themselves
    assert rose("request_prompt_tokens_sum") >= sum(map(len, prompts))
    assert rose("request_generation_tokens_sum") >= generated
    assert rose("request_failed_total") == 0
    # nothing runs now, and the engine gauges say so
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    assert after["npu_cache_usage_perc"] == 0


def test_non_stream_client_that_gives_up_leaves_nothing_behind(server, kv_idle_http, s_per_token):
    body = {"model": "demo", "prompt": "a long answer please", "max_tokens": LONG_MAX_TOKENS,
            "n": 4, "temperature": 1.0, "ignore_eos": True}  # fmt: skip

    async def give_up() -> float:
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            request = asyncio.ensure_future(c.post("/v1/completions", json=body))
            # once the replica runs it (polled), the client gives up: its connection closes
            running = await asyncio.to_thread(_wait_running)
            assert not request.done(), "the request ended before the client could give up"
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            assert running, "the replica never ran the request"
            return time.monotonic()

    gave_up_at = asyncio.run(give_up())
    assert_freed_early(kv_idle_http, gave_up_at, LONG_MAX_TOKENS, s_per_token)


DOC_EXAMPLES = [  # MindIE's chat and completions request examples, on the model served here
    ("/v1/chat/completions", {
        "model": "demo", "messages": [{"role": "user", "content": "You are a helpful assistant."}],
        "max_tokens": 20, "presence_penalty": 1.03, "frequency_penalty": 1.0, "seed": None,
        "temperature": 0.5, "top_p": 0.95, "stream": False}),
    ("/v1/chat/completions", {
        "model": "demo", "messages": [
            {"role": "system", "content": "You are a student who is good at math."},
            {"role": "user", "content": "what is your hobby?"}],
        "max_tokens": 20, "presence_penalty": 1.03, "frequency_penalty": 1.0, "seed": None,
        "temperature": 0.5, "top_p": 0.95, "stream": False}),
    ("/v1/completions", {
        "model": "demo", "prompt": "who are you", "temperature": 1, "max_tokens": 5,
        "use_beam_search": True, "ignore_eos": True, "n": 2, "best_of": 2, "stream": True,
        "logprobs": 2}),
    ("/v1/completions", {
        "model": "demo", "prompt": "who are you", "temperature": 1, "max_tokens": 5,
        "ignore_eos": True, "n": 2, "best_of": 2, "stream": False, "logprobs": 2}),
]  # fmt: skip


@pytest.mark.parametrize("path, body", DOC_EXAMPLES)
@pytest.mark.parametrize("stream", [False, True])
def test_documented_examples_over_http(http, kv_idle_http, path, body, stream):
    if body.get("use_beam_search") and not stream:
        body = {**body, "stream": False}
    elif not body.get("use_beam_search"):
        body = {**body, "stream": stream}
    if path == "/v1/completions" and body["stream"] and not body.get("use_beam_search"):
        body = {**body, "n": 2, "best_of": 2}  # streaming needs best_of == n
    if not body["stream"]:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] in ("chat.completion", "text_completion")
        assert len(out["choices"]) == body.get("n", 1)
        assert out["usage"]["total_tokens"] == (
            out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
        )
    else:
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            events = _events(r)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert all(e["object"].endswith(("chunk", "text_completion")) for e in events[:-1])
    assert kv_idle_http()


def test_databricks_family_over_ray(server, kv_idle_http):
    """The databricks-sdk and the openai client against the Ray-served app: every task, the
    embedding deployment included."""
    from databricks.sdk import WorkspaceClient
    from databricks.sdk.service.serving import ChatMessage, ChatMessageRole
    from serve_helpers import EMBEDDING_ENDPOINT

    w = WorkspaceClient(host=server, token="unused")
    listed = {(e.name, e.task) for e in w.serving_endpoints.list()}
    assert listed == {("demo", "llm/v1/chat"), (EMBEDDING_ENDPOINT, "llm/v1/embeddings")}
    chat = w.serving_endpoints.query(
        "demo", messages=[ChatMessage(role=ChatMessageRole.USER, content="hi")], max_tokens=4
    )
    assert chat.usage.completion_tokens <= 4
    batch = w.serving_endpoints.query("demo", prompt=["a", "b"], max_tokens=3, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    vectors = w.serving_endpoints.query(EMBEDDING_ENDPOINT, input=["a cat", "a kitten"]).data
    assert [len(v.embedding) for v in vectors] == [384, 384]
    oai = w.serving_endpoints.get_open_ai_client(max_retries=0)
    events = list(oai.responses.create(model="demo", input="hi", max_output_tokens=3, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert kv_idle_http()


def test_batch_completion_stream_disconnect_frees_every_prompt(server, kv_idle_http, s_per_token):
    # greedy: nothing but the length could end any of the six choices
    body = {"prompt": ["tell me a story", "and another", "and a third"],
            "max_tokens": LONG_MAX_TOKENS, "stream": True, "n": 2, "temperature": 0}  # fmt: skip
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/serving-endpoints/demo/invocations", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert "error" not in json.loads(line[len("data: ") :]), line
                    break  # the first choice's first text arrived: hang up
    assert_freed_early(kv_idle_http, time.monotonic(), LONG_MAX_TOKENS - 1, s_per_token)


# -- last: a minute of mixed traffic on the same app ---------------------------------------------

from bench.soak import IDLE_KEYS, rss_growth, settle, soak  # noqa: E402

RSS_SLACK_MB = 256  # an allocator's high-water mark moves; a leak over a minute goes past it


def _stats_or_why() -> dict | str:
    try:
        return _replica_stats()
    except Exception as exc:  # a failure message's diagnostic only
        return f"{type(exc).__name__}: {exc}"


# The soak's length: 20 s in the suite; SERVE_APP_SOAK_S=600 makes it a real soak (bench/soak.py
# runs the same traffic on its own for longer still).
SOAK_S = float(os.environ.get("SERVE_APP_SOAK_S", "20"))


def test_mixed_traffic_leaves_the_server_idle(server):
    """A soak (bench/soak.py's traffic, SOAK_S long): every family, streams and not, with client
    disconnects, server and client timeouts and stopInfer calls; afterwards nothing runs or
    waits, the KV cache is empty and the replicas' resident memory has not grown."""
    asyncio.run(soak(server, duration_s=5, clients=8, seed=1))  # warm-up
    settle(server)
    before = replica_rss_mb()
    result = asyncio.run(soak(server, duration_s=SOAK_S, clients=8, seed=0))
    assert result["num_errors"] == 0, result["errors"]
    assert set(result["by_fate"]) == {"complete", "disconnect", "server_timeout",
                                      "client_timeout", "stop"}  # fmt: skip
    assert "embeddings" in result["by_family"] and result["requests"] > 1.5 * SOAK_S
    idle = settle(server)
    # the replica's own counters next to the ingress's gauges: a request the engine still
    # holds, or a stale gauge
    assert idle == dict.fromkeys(IDLE_KEYS, 0.0), (idle, _stats_or_why())
    growth = rss_growth(before, replica_rss_mb())
    assert {"ModelReplica", "Ingress", "engine process"} <= set(growth), growth
    assert all(mb <= RSS_SLACK_MB for mb in growth.values()), growth
