"""The app under Ray Serve, over real HTTP: placement, every family's documented example, the
openai client, disconnects, stopInfer, readiness, metrics and the OpenAPI docs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


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
    # the ingress and the tokenizer pool ask for no NPU, so they run on the head as well
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


def test_client_disconnect_aborts_and_frees_kv(server, kv_idle_http):
    body = {"inputs": "tell me a long story", "stream": True,
            "parameters": {"max_new_tokens": 60, "details": True}}  # fmt: skip
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/infer", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the first token arrived: hang up
    assert kv_idle_http()


def test_stop_infer_over_http(server, http, kv_idle_http):
    body = {"id": "stop-me", "text_input": "count", "parameters": {"max_new_tokens": 64}}
    result = {}

    def run():
        with httpx.Client(base_url=server, timeout=60) as c:
            with c.stream("POST", "/v2/models/demo/generate_stream", json=body) as r:
                result["events"] = _events(r)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = http.post("/v2/models/demo/stopInfer", json={"id": "stop-me"})
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200 and r.json() == {"id": "stop-me"}
    thread.join(30)
    assert kv_idle_http()
    assert http.post("/v2/models/demo/stopInfer", json={"id": "stop-me"}).status_code == 404


def test_metrics(http):
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


def test_non_stream_client_that_gives_up_leaves_nothing_behind(server, kv_idle_http):
    body = {"model": "demo", "prompt": "a long answer please", "max_tokens": 64,
            "n": 4, "temperature": 1.0}  # fmt: skip
    with httpx.Client(base_url=server, timeout=0.2) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    assert kv_idle_http(10)


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


def test_batch_completion_stream_disconnect_frees_every_prompt(server, kv_idle_http):
    body = {"prompt": ["tell me a story", "and another", "and a third"], "max_tokens": 60,
            "stream": True, "n": 2}  # fmt: skip
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/serving-endpoints/demo/invocations", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the first choice's first text arrived: hang up
    assert kv_idle_http()
