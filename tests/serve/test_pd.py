"""PD disaggregation across nodes: prefill on one NPU worker, decode on the other, over HTTP.

The cluster (tests/serve/conftest.py) has a head without NPU and two workers advertising
`NPU: 1` each, so the prefill and the decode replica must land on different workers and the KV
crosses nodes through the Ray object store. Outputs must equal a colocated engine's, token for
token, for greedy and for seeded sampling. Last, faults: the decode replica killed mid-stream
ends the stream with an error within seconds and is replaced; the prefill replica killed once it
has handed over does not lose the stream. The surviving side's KV pool goes back to idle.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import pytest
from serve_helpers import (
    ERROR_WITHIN_S,
    FAULT_STREAM,
    LONG_KV_BLOCKS,
    LONG_MAX_TOKENS,
    PD_ARGS,
    PD_LONG_ARGS,
    actors,
    assert_freed_early,
    deploy,
    kill,
    seconds_per_token,
    serves_again,
    stop_infer_mid_stream,
    stream_until_fault,
)

PROMPTS = [
    [5618, 19678, 701, 9072, 13],
    [9707, 11, 1879, 0],
    list(range(1000, 1040)),
    [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
]


@pytest.fixture(scope="module")
def server(cluster):
    """The PD app, with maxIterTimes LONG_MAX_TOKENS (PD_LONG_ARGS): a request ended early
    (client gone, stopInfer, timeout) is shown to free its KV blocks long before it could have
    ended by itself."""
    from ray import serve

    yield deploy(cluster, PD_LONG_ARGS)
    serve.delete("serve_app")


@pytest.fixture(scope="module")
def reference():
    """A colocated engine on the same weights and limits, in this process."""
    from serve_app.config import load_config
    from serve_app.engine import LLM

    config = load_config(copy.deepcopy(PD_ARGS)).engine_config()
    llm = LLM(config.model, **{"dtype": config.dtype, "maxSeqLen": config.max_seq_len,
                              "maxIterTimes": config.max_iter_times,
                              "cacheBlockSize": config.block_size,
                              "kvCacheBlocks": config.num_kv_blocks})  # fmt: skip
    return llm


def _stream_ids(client: httpx.Client, body: dict) -> tuple[list[int], dict]:
    ids, last = [], {}
    with client.stream("POST", "/infer_token", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids.append(event["token"]["id"])
                last = event
    return ids, last


def test_prefill_and_decode_run_on_different_npu_nodes(cluster, http):
    from ray import serve

    infos = {
        name: serve.get_deployment_handle(name, app_name="serve_app")
        .device_info.remote()
        .result(timeout_s=30)
        for name in ("PrefillReplica", "DecodeReplica")
    }
    nodes = {name: info["node_id"] for name, info in infos.items()}
    assert set(nodes.values()) == cluster.npu_node_ids  # one each, never the head
    assert all(info["ASCEND_RT_VISIBLE_DEVICES"] == "0" for info in infos.values())


@pytest.mark.parametrize(
    "sampling",
    [{"do_sample": False}, {"temperature": 1.0, "top_k": 50, "seed": 42}],
    ids=["greedy", "seeded"],
)
def test_outputs_equal_colocated_token_for_token(server, reference, kv_idle_http, sampling):
    from serve_app.engine import SamplingParams

    params = SamplingParams(
        max_tokens=12,
        temperature=0.0 if not sampling.get("do_sample", True) else sampling["temperature"],
        top_k=sampling.get("top_k", 0),
        seed=sampling.get("seed"),
    )
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with httpx.Client(base_url=server, timeout=60) as c:
            body = {"input_id": PROMPTS[i], "parameters": {"max_new_tokens": 12, **sampling}}
            results[i] = _stream_ids(c, body)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(PROMPTS))] == expected
    assert kv_idle_http()


def test_token_count_rules(http):
    # the limit comes from maxIterTimes: decode runs maxIterTimes steps after prefill's token
    body = {"model": "demo", "prompt": "count with me", "temperature": 0}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["completion_tokens"] == LONG_MAX_TOKENS + 1
    # a smaller max_tokens is exact, and the stream's last event counts both sides
    usage = http.post("/v1/completions", json={**body, "max_tokens": 5}).json()["usage"]
    assert usage["completion_tokens"] == 5
    ids, last = _stream_ids(http, {"input_id": PROMPTS[0], "parameters": {"details": True}})
    assert len(ids) == last["details"]["generated_tokens"] == 20  # max_new_tokens default


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "demo", "prompt": "x", "n": 2, "temperature": 1}, "n"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "stop": ["a"]}, "stop"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "logprobs": 1}, "logprobs"),
        ("/v1/chat/completions",
         {"model": "demo", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
         "logprobs"),
        ("/v2/models/demo/generate", {"text_input": "x", "parameters": {"stop": "a"}}, None),
    ],
)  # fmt: skip
def test_unsupported_parameters_are_refused_before_any_work(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert "not supported in PD" in message
    if param is not None:
        assert error["param"] == param


def test_pd_metrics(http):
    text = http.get("/metrics").text
    for stage in ("queue", "prefill", "handoff", "first_decode_step"):
        assert f'stage="{stage}"' in text, stage
    assert "kv_transfer_bytes_total" in text and "kv_handoff_seconds_bucket" in text
    assert 'kv_lost_total{model_name="demo"} 0.0' in text


def test_databricks_family_under_pd(http, kv_idle_http):
    """JSON output keeps its grammar across the prefill/decode hand-off; a batch of prompts runs
    as one PD request each; what PD cannot run is refused in Databricks' shape."""
    import jsonschema

    schema = {"type": "object", "required": ["name", "tags"],
              "properties": {"name": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string"}}}}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
            "response_format": fmt}  # fmt: skip
    invoke = "/serving-endpoints/demo/invocations"
    r = http.post(invoke, json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    r = http.post(invoke, json={"prompt": ["a", "b"], "max_tokens": 3})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = http.post(invoke, json={**body, "n": 2})
    assert r.status_code == 400 and r.json()["error_code"] == "BAD_REQUEST"
    assert "not supported in PD" in r.json()["message"]
    assert kv_idle_http()


# -- what ends a request early (the app's long limits make that visible), then faults ----------


@pytest.fixture(scope="module")
def pd_s_per_token(server):
    """Seconds per token of an unaborted greedy PD request (the abort tests' yardstick)."""
    return seconds_per_token(server)


ROLES = ("PrefillReplica", "DecodeReplica")


def _role_stats(roles: tuple[str, ...] = ROLES) -> dict[str, dict]:
    """Engine stats of each role's (single) replica, asked of each directly."""
    from ray import serve

    return {
        name: serve.get_deployment_handle(name, app_name="serve_app")
        .stats.remote()
        .result(timeout_s=30)
        for name in roles
    }


def _idle(stats: dict) -> bool:
    return (
        stats["num_blocks"] == LONG_KV_BLOCKS  # the long app's replica, not a replaced one
        and not stats["num_running"]
        and not stats["num_waiting"]
        and stats["num_free_blocks"] == stats["num_blocks"]
    )


def both_sides_idle(timeout_s: float = 10.0, roles: tuple[str, ...] = ROLES) -> bool:
    """True once neither the prefill nor the decode replica (or only those of `roles`) runs
    anything or holds a KV block (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(_idle(stats) for stats in _role_stats(roles).values()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_disconnect_during_decode_frees_both_sides(server, kv_idle_http, pd_s_per_token):
    body = {"inputs": "a long story", "stream": True,
            "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "do_sample": False}}  # fmt: skip
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/infer", json=body) as r:
            assert r.status_code == 200
            seen, decode = 0, None
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert "error" not in json.loads(line[6:]), line
                    seen += 1
                if seen == 3:  # prefill's token and two decode tokens: hang up mid-decode
                    # (asked while the stream is open: leaving the loop closes the connection)
                    decode = _role_stats()["DecodeReplica"]
                    break
            assert seen == 3
    # the request was on the decode side when the client went away
    assert decode["num_blocks"] == LONG_KV_BLOCKS, decode
    assert decode["num_running"] == 1, decode
    assert decode["num_free_blocks"] < decode["num_blocks"], decode
    assert_freed_early(both_sides_idle, time.monotonic(), LONG_MAX_TOKENS - 3, pd_s_per_token)
    assert kv_idle_http()


def test_stop_infer_frees_both_sides(server, http, kv_idle_http, pd_s_per_token):
    body = {"id": "pd-stop", "text_input": "go",
            "parameters": {"max_new_tokens": LONG_MAX_TOKENS, "temperature": 0,
                           "details": True}}  # fmt: skip
    # stopped after the prefill's token and two of the decode's
    events, stopped_at = stop_infer_mid_stream(server, http, "pd-stop", body, 3)
    details = events[-1]["details"]  # the stream ended early, as stopped
    assert details["finish_reason"] == "stop_sequence"
    assert 3 <= details["generated_tokens"] < LONG_MAX_TOKENS
    left = LONG_MAX_TOKENS - details["generated_tokens"]
    assert_freed_early(both_sides_idle, stopped_at, left, pd_s_per_token)
    assert kv_idle_http()
    assert http.post("/v2/models/demo/stopInfer", json={"id": "pd-stop"}).status_code == 404


def _first_token_s(url: str) -> float:
    """Seconds from sending a PD request to its first token (the prefill and the hand-off)."""
    body = {"inputs": "x", "stream": True, "parameters": {"max_new_tokens": 2}}
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/infer", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
            return time.monotonic() - start


def test_a_timeout_during_decode_frees_both_sides(server, http, kv_idle_http, pd_s_per_token):
    """The request's timeout runs out while the decode replica generates: a timeout long enough
    for the prefill, the hand-off and some decode steps (measured here, so on any machine), far
    shorter than the request's whole length."""
    timeout = round(3 * _first_token_s(server) + 20 * pd_s_per_token, 3)
    assert timeout < LONG_MAX_TOKENS * pd_s_per_token / 4, "make the request longer"
    body = {"inputs": "x", "stream": True, "parameters": {
        "max_new_tokens": LONG_MAX_TOKENS, "do_sample": False, "timeout": timeout}}  # fmt: skip
    events = []
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/infer", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    timed_out_at = time.monotonic()
    tokens = [e for e in events if "error" not in e]
    assert len(tokens) >= 2, events  # the decode replica was generating when time ran out
    assert (
        events[-1]["error_type"] == "Incomplete Generation" and "timed out" in events[-1]["error"]
    )
    assert_freed_early(both_sides_idle, timed_out_at, LONG_MAX_TOKENS - len(tokens), pd_s_per_token)
    assert kv_idle_http()
    # the same without a stream: a 500 once the time is out, both sides freed
    body["stream"] = False
    r = http.post("/infer", json=body)
    timed_out_at = time.monotonic()
    assert r.status_code == 500 and r.json()["error_type"] == "Incomplete Generation"
    assert_freed_early(both_sides_idle, timed_out_at, LONG_MAX_TOKENS, pd_s_per_token)
    assert kv_idle_http()


# -- faults, on the long app (last: they kill and replace its replicas) ------------------------


def test_a_decode_replica_killed_mid_stream_ends_it_and_is_replaced(server):
    (decode,) = actors("DecodeReplica")
    body = {**FAULT_STREAM, "max_tokens": LONG_MAX_TOKENS}
    # the first event is the prefill replica's token; the second comes from the decode replica
    events, ended_s = stream_until_fault(server, lambda: kill(decode), after=2, body=body)
    assert ended_s < ERROR_WITHIN_S
    assert "a replica serving the request failed" in events[-1]["error"]["message"]
    assert both_sides_idle(roles=("PrefillReplica",))  # it holds nothing of the request
    serves_again(server)
    assert [a["name"] for a in actors("DecodeReplica")] != [decode["name"]]


def test_a_prefill_replica_killed_after_the_hand_off_does_not_lose_the_stream(server):
    serves_again(server)
    (prefill,) = actors("PrefillReplica")
    body = {**FAULT_STREAM, "max_tokens": 300}
    with httpx.Client(base_url=server, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        kill(prefill)  # the first token is out: the decode replica has it
    assert "error" not in events[-1], events[-1]
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert both_sides_idle(roles=("DecodeReplica",))
    serves_again(server)
    assert [a["name"] for a in actors("PrefillReplica")] != [prefill["name"]]
