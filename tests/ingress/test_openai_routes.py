"""/v1/chat/completions and /v1/completions over the in-process app (demo-tiny).

Validation tables first (each bad value -> 400 in the OpenAI envelope, naming the parameter and
its range; refused before any model work), then MindIE's chat and completions request examples,
exact stop strings, usage arithmetic and streaming, each leaving no KV block behind."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from serve_app.messages import (
    ChoiceDelta,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol.sampling import sampling_params
from tests.ingress.conftest import LONG_MAX_TOKENS
from tests.stepping import Stepping

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "demo", "prompt": "hi"}
U64, I32 = 2**64 - 1, 2**31 - 1

CHAT_INVALID = [  # (field, value, param named, text the message contains)
    ("model", "", "model", "letters, digits"),
    ("model", "-demo", "model", "letters, digits"),
    ("model", "demo.", "model", "letters, digits"),
    ("model", "x" * 257, "model", "256"),
    ("model", 5, "model", "letters, digits"),
    ("messages", [], "messages", "non-empty"),
    ("messages", "hi", "messages", "list"),
    ("messages", [{"role": "bot", "content": "x"}], "messages[0].role", "'tool'"),
    ("messages", [{"content": "x"}], "messages[0].role", "required"),
    ("messages", [{"role": "user", "content": ""}], "messages[0].content", "non-empty"),
    ("messages", [{"role": "user"}], "messages[0].content", "required"),
    ("messages", [{"role": "user", "content": []}], "messages[0].content", "non-empty"),
    ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content",
     "only text parts"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": ""}]}],
     "messages[0].content", "non-empty"),
    ("messages", [{"role": "user", "content": "x" * (512 * 1024 + 1)}], "messages",
     "(0, 524288]"),
    ("max_tokens", 0, "max_tokens", "(0, 2147483647]"),
    ("max_tokens", I32 + 1, "max_tokens", "(0, 2147483647]"),
    ("max_tokens", 1.5, "max_tokens", "integer"),
    ("max_tokens", "5", "max_tokens", "integer"),
    ("presence_penalty", -2.01, "presence_penalty", "[-2.0, 2.0]"),
    ("presence_penalty", 2.01, "presence_penalty", "[-2.0, 2.0]"),
    ("frequency_penalty", -3, "frequency_penalty", "[-2.0, 2.0]"),
    ("frequency_penalty", 2.5, "frequency_penalty", "[-2.0, 2.0]"),
    ("seed", 0, "seed", f"(0, {U64}]"),
    ("seed", U64 + 1, "seed", f"(0, {U64}]"),
    ("temperature", 0, "temperature", "(0.0, 2.0]"),
    ("temperature", 2.01, "temperature", "(0.0, 2.0]"),
    ("temperature", "0.5", "temperature", "number"),
    ("top_p", 0.0, "top_p", "(0.0, 1.0]"),
    ("top_p", 1.01, "top_p", "(0.0, 1.0]"),
    ("stream", "yes", "stream", "boolean"),
    ("stop", "", "stop", "1 to 32768"),
    ("stop", [""], "stop", "non-empty strings"),
    ("stop", ["a" * 20000, "b" * 20000], "stop", "32768"),
    ("stop_token_ids", [1.5], "stop_token_ids[0]", "integer"),
    ("top_k", 0, "top_k", "-1 or in (0, 2147483647]"),
    ("top_k", -2, "top_k", "-1 or in (0, 2147483647]"),
    ("top_k", I32 + 1, "top_k", "-1 or in (0, 2147483647]"),
    ("repetition_penalty", 0, "repetition_penalty", "(0.0, 2.0]"),
    ("repetition_penalty", 2.1, "repetition_penalty", "(0.0, 2.0]"),
    ("ignore_eos", 1, "ignore_eos", "boolean"),
    ("skip_special_tokens", "no", "skip_special_tokens", "boolean"),
    ("n", 0, "n", "[1, 128]"),
    ("n", 129, "n", "[1, 128]"),
    ("logprobs", 1, "logprobs", "boolean"),
    ("top_logprobs", 21, "top_logprobs", "[0, 20]"),
    ("top_logprobs", -1, "top_logprobs", "[0, 20]"),
    ("top_logprobs", 2, "top_logprobs", "logprobs is true"),
    ("stream_options", {"include_usage": True}, "stream_options", "stream is true"),
    ("priority", 0, "priority", "[1, 5]"),
    ("priority", 6, "priority", "[1, 5]"),
    ("stream_interval", 0, "stream_interval", "[1, 2147483647]"),
    ("stream_interval", I32 + 1, "stream_interval", "[1, 2147483647]"),
    ("stream_interval", 2.5, "stream_interval", "integer"),
]  # fmt: skip

COMPLETION_INVALID = [
    ("model", 5, "model", "string"),
    ("prompt", "", "prompt", "non-empty string"),
    ("prompt", [], "prompt", "list of token ids"),
    ("prompt", ["a"], "prompt", "list of token ids"),
    ("prompt", [1, True], "prompt", "list of token ids"),
    ("prompt", "x" * (4 * 1024 * 1024 + 1), "prompt", "4194304"),
    ("prompt", [10**9], "prompt", "vocabulary"),
    ("use_beam_search", "yes", "use_beam_search", "boolean"),
    ("best_of", 0, "best_of", "[1, 128]"),
    ("best_of", 129, "best_of", "[1, 128]"),
    ("n", 0, "n", "[1, 128]"),
    ("n", 129, "n", "[1, 128]"),
    ("logprobs", -1, "logprobs", "[0, 5]"),
    ("logprobs", 6, "logprobs", "[0, 5]"),
    ("logprobs", True, "logprobs", "integer"),
    ("max_tokens", 0, "max_tokens", "(0, 2147483647]"),
    ("max_tokens", I32 + 1, "max_tokens", "(0, 2147483647]"),
    ("seed", 0, "seed", f"(0, {U64}]"),
    ("seed", U64 + 1, "seed", f"(0, {U64}]"),
    ("stop", "", "stop", "1 to 32768"),
    ("stop", "x" * 32769, "stop", "1 to 32768"),
    ("stop", ["ok", ""], "stop", "non-empty strings"),
    ("stop", ["a" * 16384, "b" * 16385], "stop", "32768"),
    ("stop", 5, "stop", "a string or a list"),
    ("stream", 0, "stream", "boolean"),
    ("repetition_penalty", 0.0, "repetition_penalty", "(0.0, 2.0]"),
    ("repetition_penalty", 2.5, "repetition_penalty", "(0.0, 2.0]"),
    ("presence_penalty", -2.5, "presence_penalty", "[-2.0, 2.0]"),
    ("frequency_penalty", 2.5, "frequency_penalty", "[-2.0, 2.0]"),
    ("temperature", -0.1, "temperature", ">= 0.0"),
    ("top_p", 1e-6, "top_p", "(1e-06, 1.0]"),
    ("top_p", 1.5, "top_p", "(1e-06, 1.0]"),
    ("top_k", 0, "top_k", "-1 or in (0, 2147483647]"),
    ("top_k", -5, "top_k", "-1 or in (0, 2147483647]"),
    ("stop_token_ids", ["a"], "stop_token_ids[0]", "integer"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output", "boolean"),
    ("ignore_eos", "no", "ignore_eos", "boolean"),
    ("skip_special_tokens", 0, "skip_special_tokens", "boolean"),
    ("priority", 0, "priority", "[1, 5]"),
    ("priority", 6, "priority", "[1, 5]"),
    ("stream_interval", 0, "stream_interval", "[1, 2147483647]"),
    ("stream_interval", "4", "stream_interval", "integer"),
]

COMPLETION_CROSS = [  # (fields, param named, message text): the completions cross-rules
    ({"use_beam_search": True, "stop": "x"}, "stop", "use_beam_search"),
    ({"n": 2, "temperature": 0}, "temperature", "must be > 0"),
    ({"best_of": 2, "temperature": 0}, "temperature", "must be > 0"),
    ({"n": 3, "best_of": 2}, "best_of", "must be >= n"),
    ({"stream": True, "best_of": 2}, "best_of", "without n"),
    ({"stream": True, "n": 2, "best_of": 3}, "best_of", "equal to n"),
]


def assert_openai_error(response, status: int, param: str, text: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")
    assert text in error["message"] and param in error["message"], error["message"]


@pytest.mark.parametrize("field, value, param, text", CHAT_INVALID)
def test_chat_validation(client, field, value, param, text):
    response = client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert_openai_error(response, 400, param, text)


@pytest.mark.parametrize("field, value, param, text", COMPLETION_INVALID)
def test_completion_validation(client, field, value, param, text):
    response = client.post("/v1/completions", json={**COMPLETION, field: value})
    assert_openai_error(response, 400, param, text)


@pytest.mark.parametrize("fields, param, text", COMPLETION_CROSS)
def test_completion_cross_rules(client, fields, param, text):
    response = client.post("/v1/completions", json={**COMPLETION, **fields})
    assert_openai_error(response, 400, param, text)


@pytest.mark.parametrize(
    "path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_missing_fields_unknown_model_and_bad_json(client, path, base):
    for field in base:
        body = {k: v for k, v in base.items() if k != field}
        assert_openai_error(client.post(path, json=body), 400, field, "required")
    assert_openai_error(client.post(path, json={**base, "model": "other"}), 404, "model", "other")
    response = client.post(path, content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def _app_like(route_app, backend=None, **server) -> TestClient:
    """Another app over the same backend (or a fake one), with ServerConfig changes."""
    from serve_app.ingress.app import create_app

    config = route_app.state.pipeline.config
    config = config.model_copy(
        update={"ServerConfig": config.ServerConfig.model_copy(update=server)}
    )
    return TestClient(create_app(config, backend or route_app.state.pipeline.backend))


PD_REFUSED = [
    ("/v1/chat/completions", CHAT, {"stop": "x"}, "stop"),
    ("/v1/chat/completions", CHAT, {"include_stop_str_in_output": True},
     "include_stop_str_in_output"),
    ("/v1/chat/completions", CHAT, {"n": 2}, "n"),
    ("/v1/chat/completions", CHAT, {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", CHAT, {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ("/v1/completions", COMPLETION, {"stop": ["x"]}, "stop"),
    ("/v1/completions", COMPLETION, {"include_stop_str_in_output": True},
     "include_stop_str_in_output"),
    ("/v1/completions", COMPLETION, {"n": 2}, "n"),
    ("/v1/completions", COMPLETION, {"best_of": 2}, "best_of"),
    ("/v1/completions", COMPLETION, {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", COMPLETION, {"logprobs": 0}, "logprobs"),
    # PD refusals come before the other cross-rules, so they name what PD cannot run
    ("/v1/completions", COMPLETION, {"use_beam_search": True, "stop": "x"}, "stop"),
]  # fmt: skip


@pytest.fixture(scope="module")
def pd_client(route_app):
    with _app_like(route_app, inferMode="dmi") as c:
        yield c


@pytest.mark.parametrize("path, base, fields, param", PD_REFUSED)
def test_pd_mode_refuses_before_any_work(pd_client, path, base, fields, param):
    response = pd_client.post(path, json={**base, **fields})
    assert_openai_error(response, 400, param, "not supported in PD (inferMode dmi) mode")


# -- generation -------------------------------------------------------------------------------


def sse_events(response) -> list:
    """The data payloads of an SSE body, parsed; the final [DONE] kept as the string."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def check_usage(usage: dict) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# MindIE's documented chat request examples (the model: the one served here)
CHAT_SINGLE = {
    "model": "demo",
    "messages": [{"role": "user", "content": "You are a helpful assistant."}],
    "max_tokens": 20, "presence_penalty": 1.03, "frequency_penalty": 1.0, "seed": None,
    "temperature": 0.5, "top_p": 0.95, "stream": False,
}  # fmt: skip
CHAT_MULTI = {
    **CHAT_SINGLE,
    "messages": [
        {"role": "system", "content": "You are a student who is good at math."},
        {"role": "user", "content": "what is your hobby?"},
    ],
}
MINDIE_FINISH = {"eos_token", "length", "stop_sequence"}


def template_tokens(client, messages) -> int:
    pool = client.app.state.pipeline.backend.tokenizer_pool
    req = TokenizeRequest(model="demo", kind="chat", messages=messages, param="messages")
    return client.portal.call(pool.tokenize, req).num_prompt_tokens


@pytest.mark.parametrize("example", [CHAT_SINGLE, CHAT_MULTI], ids=["single", "multi"])
def test_chat_documented_examples(client, kv_idle, example):
    body = client.post("/v1/chat/completions", json=example).json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == "demo"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "finish_reason"} and choice["index"] == 0
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] in MINDIE_FINISH
    usage = body["usage"]
    check_usage(usage)
    assert 1 <= usage["completion_tokens"] <= 20
    # the prompt counts the chat template's tokens, not only the contents'
    assert usage["prompt_tokens"] == template_tokens(client, example["messages"])
    assert kv_idle()


@pytest.mark.parametrize("example", [CHAT_SINGLE, CHAT_MULTI], ids=["single", "multi"])
def test_chat_documented_examples_stream_match_non_stream(client, kv_idle, example):
    fixed = {**example, "seed": 11, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=fixed).json()
    events = sse_events(client.post("/v1/chat/completions", json={**fixed, "stream": True}))
    for event in events:
        assert list(event) == ["id", "object", "created", "model", "choices"]
        assert event["object"] == "chat.completion.chunk" and event["id"] == events[0]["id"]
        (choice,) = event["choices"]
        assert list(choice) == ["index", "delta", "finish_reason"] and choice["index"] == 0
    *content, last = events
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in content)
    assert all(e["choices"][0]["finish_reason"] is None for e in content)
    assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    text = "".join(e["choices"][0]["delta"]["content"] for e in content)
    assert text == whole["choices"][0]["message"]["content"]
    assert kv_idle()


def test_chat_include_usage_n_and_logprobs(client, kv_idle):
    request = {
        **CHAT,
        "max_tokens": 4,
        "n": 2,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(client.post("/v1/chat/completions", json=request))
    usage_event = events[-1]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 8
    check_usage(usage_event["usage"])
    finals = [e["choices"][0] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1]
    assert all(c["finish_reason"] == "length" and c["delta"] == {} for c in finals)
    tokens = [
        e["choices"][0]["logprobs"]["content"] for e in events[:-1] if e["choices"][0]["delta"]
    ]
    assert sum(map(len, tokens)) == 8
    assert all(len(t["top_logprobs"]) == 2 for entries in tokens for t in entries)
    body = client.post(
        "/v1/chat/completions", json={**request, "stream": False, "stream_options": None}
    ).json()
    assert [len(c["logprobs"]["content"]) for c in body["choices"]] == [4, 4]
    assert body["usage"]["completion_tokens"] == 8
    assert kv_idle()


def test_chat_max_tokens_is_refused_above_max_iter_times(client, kv_idle):
    """Chat's documented range is (0, maxIterTimes]: unlike /v1/completions, no cap."""
    request = {**CHAT, "max_tokens": 64, "ignore_eos": True, "top_k": 1}
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["usage"]["completion_tokens"] == 64  # maxIterTimes of the route test config
    assert body["choices"][0]["finish_reason"] == "length"
    for value in (65, I32):
        refused = client.post("/v1/chat/completions", json={**request, "max_tokens": value})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "max_tokens"
        assert error["message"] == f"max_tokens must be in (0, 64] (maxIterTimes), got {value}"
    assert kv_idle()


def stop_across_tokens(deltas: list[str]) -> str:
    """A stop string that spans the boundary between two non-empty stream deltas."""
    for left, right in zip(deltas[1:], deltas[2:], strict=False):
        if len(left) >= 2 and len(right) >= 2:
            return left[-2:] + right[:2]
    raise AssertionError(f"no two neighbouring deltas to span: {deltas}")


def test_chat_stop_string_is_exact(client, kv_idle):
    greedy = {**CHAT, "max_tokens": 16, "ignore_eos": True, "top_k": 1, "stream": True}
    events = sse_events(client.post("/v1/chat/completions", json=greedy))
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events]
    text, stop = "".join(deltas), stop_across_tokens(deltas)
    body = client.post(
        "/v1/chat/completions", json={**greedy, "stream": False, "stop": ["\x00never", stop]}
    ).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop_sequence"
    assert body["usage"]["completion_tokens"] < 16
    assert kv_idle()


def greedy_completion(client, **fields) -> list[str]:
    """The text deltas of a greedy completion stream (token boundaries)."""
    request = {
        **COMPLETION,
        "prompt": "who are you",
        "temperature": 0,
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
        **fields,
    }
    events = sse_events(client.post("/v1/completions", json=request))
    return [e["choices"][0]["text"] for e in events]


@pytest.mark.parametrize("include", [False, True])
def test_completion_stop_string_is_exact(client, kv_idle, include):
    deltas = greedy_completion(client)
    text, stop = "".join(deltas), stop_across_tokens(deltas)
    end = text.index(stop) + (len(stop) if include else 0)
    request = {
        **COMPLETION,
        "prompt": "who are you",
        "temperature": 0,
        "max_tokens": 16,
        "ignore_eos": True,
        "stop": stop,
        "include_stop_str_in_output": include,
    }
    choice = client.post("/v1/completions", json=request).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        text[:end],
        "stop",
        stop,
    )
    events = sse_events(client.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == text[:end]
    final = events[-1]["choices"][0]
    assert (final["finish_reason"], final["stop_reason"]) == ("stop", stop)
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert kv_idle()


def test_stop_strings_abort_the_engine_request(long_client, engine_watch):
    """The engine knows no stop strings: the replica finds them in the text and must abort the
    engine request there, not leave it running to max_tokens (thousands of steps here)."""
    deltas = greedy_completion(long_client)
    text, stop = "".join(deltas), stop_across_tokens(deltas)
    request = {**COMPLETION, "prompt": "who are you", "temperature": 0, "ignore_eos": True,
               "max_tokens": LONG_MAX_TOKENS, "stop": stop}  # fmt: skip
    engine_watch.steps = 0
    body = long_client.post("/v1/completions", json=request).json()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text[: text.index(stop)], "stop")
    assert body["usage"]["completion_tokens"] < 16
    engine_watch.freed_early()
    engine_watch.steps = 0
    events = sse_events(long_client.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == text[: text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    engine_watch.freed_early()
    # chat: the same rule
    greedy = {**CHAT, "max_tokens": 16, "ignore_eos": True, "top_k": 1, "stream": True}
    events = sse_events(long_client.post("/v1/chat/completions", json=greedy))
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events]
    text, stop = "".join(deltas), stop_across_tokens(deltas)
    long_chat = {**greedy, "max_tokens": LONG_MAX_TOKENS, "stream": False, "stop": [stop]}
    engine_watch.steps = 0
    body = long_client.post("/v1/chat/completions", json=long_chat).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop_sequence" and body["usage"]["completion_tokens"] < 16
    engine_watch.freed_early()


def test_completion_stop_token_id_and_token_id_prompt(client, kv_idle):
    replica = client.app.state.replica
    prompt_ids = replica.tokenizer.encode("who are you")
    pipeline = client.app.state.pipeline
    req = ReplicaRequest(
        "probe",
        prompt_ids,
        sampling_params(temperature=0, max_tokens=8, ignore_eos=True),
        stream=False,
    )
    ids = client.portal.call(pipeline.collect, "demo", req).choices[0].token_ids
    greedy = {
        **COMPLETION,
        "prompt": prompt_ids,
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
    }
    body = client.post("/v1/completions", json=greedy).json()
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["choices"][0]["text"] == "".join(greedy_completion(client, max_tokens=8))
    stop_id = ids[3]
    cut = client.post("/v1/completions", json={**greedy, "stop_token_ids": [stop_id, 2**40]})
    choice, usage = cut.json()["choices"][0], cut.json()["usage"]
    # stop_reason is a string or null (MindIE's completions type): the stop token's text
    stop_text = client.app.state.replica.tokenizer.decode([stop_id], skip_special_tokens=False)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_text)
    assert usage["completion_tokens"] == ids.index(stop_id) + 1
    assert len(usage["batch_size"]) == len(usage["queue_wait_time"]) == ids.index(stop_id) + 1
    assert body["choices"][0]["text"].startswith(choice["text"])
    assert kv_idle()


# MindIE's documented completions request examples
COMPLETION_EXAMPLE_STREAM = {
    "model": "demo", "prompt": "who are you", "temperature": 1, "max_tokens": 5,
    "use_beam_search": True, "ignore_eos": True, "n": 2, "best_of": 2, "stream": True,
    "logprobs": 2,
}  # fmt: skip
COMPLETION_EXAMPLE_NON_STREAM = {
    "model": "demo", "prompt": "who are you", "temperature": 1, "max_tokens": 5,
    "ignore_eos": True, "n": 2, "best_of": 2, "stream": False, "logprobs": 2,
}  # fmt: skip


def check_completion_body(body: dict, num_choices: int, num_tokens: int) -> None:
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["object"] == "text_completion" and body["model"] == "demo"
    assert [c["index"] for c in body["choices"]] == list(range(num_choices))
    offset = 0
    for choice in body["choices"]:
        assert list(choice) == ["index", "text", "logprobs", "stop_reason", "finish_reason"]
        assert (choice["stop_reason"], choice["finish_reason"]) == (None, "length")
        logprobs = choice["logprobs"]
        assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
        assert all(len(v) == num_tokens for v in logprobs.values())
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"][0] == offset  # runs on across choices
        offset += len(choice["text"])
    usage = body["usage"]
    check_usage(usage)
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == num_choices * num_tokens
    assert all(type(v) is int for v in usage["batch_size"] + usage["queue_wait_time"])
    assert len(usage["batch_size"]) == len(usage["queue_wait_time"]) >= 1


def test_completion_documented_stream_example_beam_search_is_one_event(client, kv_idle):
    (event,) = sse_events(client.post("/v1/completions", json=COMPLETION_EXAMPLE_STREAM))
    check_completion_body(event, 2, 5)
    assert kv_idle()


def test_completion_documented_non_stream_example(client, kv_idle):
    body = client.post("/v1/completions", json=COMPLETION_EXAMPLE_NON_STREAM).json()
    check_completion_body(body, 2, 5)
    assert len(body["usage"]["batch_size"]) == 5  # one per step: the longest choice's tokens
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        for token, chosen, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert top[token] == chosen and list(top)[0] == token and 2 <= len(top) <= 3
    assert kv_idle()


def test_completion_stream_n_best_of_equal_and_usage_on_last_chunk(client, kv_idle):
    request = {
        **COMPLETION,
        "max_tokens": 3,
        "n": 2,
        "best_of": 2,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
    }
    events = sse_events(client.post("/v1/completions", json=request))
    assert all(len(e["choices"]) == 1 for e in events)
    assert ["usage" in e for e in events] == [False] * (len(events) - 1) + [True]
    by_index: dict[int, list] = {0: [], 1: []}
    for event in events:
        by_index[event["choices"][0]["index"]].append(event["choices"][0])
    for choices in by_index.values():
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert sum(len(c["logprobs"]["tokens"]) for c in choices) == 3
    usage = events[-1]["usage"]
    check_usage(usage)
    assert usage["completion_tokens"] == 6 and len(usage["batch_size"]) == 3
    assert kv_idle()


@pytest.fixture
def paced_steps(route_app, monkeypatch):
    """Each engine step of the route app's replica at least 50 ms long. A stream whose consumer
    falls behind the engine gets the waiting tokens as one chunk, by design: demo-tiny's sub-ms
    steps outran the event loop on a busy machine (the suite's other worker), so tests of chunk
    sizes pace the engine, and the sizes they assert are stream_interval's alone (at 20 ms a
    step, a clean clone's CI once merged two of a Triton stream's chunks)."""
    return Stepping(route_app.state.replica.engine.engine, monkeypatch, pace_s=0.05)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_interval_puts_that_many_tokens_in_each_chunk(client, kv_idle, path, paced_steps):
    """vLLM's stream_interval: the first chunk at once, then 4 tokens a chunk, the rest last;
    the text and usage as a token-by-token stream's."""
    base = COMPLETION if path == "/v1/completions" else CHAT
    request = {**base, "max_tokens": 11, "ignore_eos": True, "stream": True, "seed": 7}
    if path == "/v1/completions":
        request["logprobs"] = 0  # each chunk's tokens, counted
    else:
        request.update(logprobs=True, stream_options={"include_usage": True})

    def tokens_and_text(events):
        sizes, text = [], ""
        for event in events:
            for choice in event["choices"]:
                if path == "/v1/completions":
                    sizes.append(len(choice["logprobs"]["tokens"]))
                    text += choice["text"]
                elif choice.get("logprobs"):
                    sizes.append(len(choice["logprobs"]["content"]))
                    text += choice["delta"].get("content") or ""
        return sizes, text, events[-1]["usage"]["completion_tokens"]

    by_token = tokens_and_text(sse_events(client.post(path, json=request)))
    by_four = tokens_and_text(sse_events(client.post(path, json={**request, "stream_interval": 4})))
    assert by_token[0] == [1] * 11
    assert by_four[0] == [1, 4, 4, 2]
    assert by_four[1:] == by_token[1:] and by_four[2] == 11
    assert kv_idle()


def test_the_servers_stream_interval_applies_unless_a_request_asks_for_more(
    route_app, kv_idle, paced_steps
):
    """ServerConfig.streamInterval 3: every stream's chunks carry 3 tokens (first and last
    aside); a request's stream_interval only raises it."""
    request = {**COMPLETION, "max_tokens": 11, "ignore_eos": True, "stream": True, "logprobs": 0}

    def sizes(client, **fields):
        events = sse_events(client.post("/v1/completions", json={**request, **fields}))
        return [len(c["logprobs"]["tokens"]) for e in events for c in e["choices"]]

    def infer_events(client, path, body):
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        return [line for line in response.text.splitlines() if line.startswith("data: ")]

    triton = {"text_input": "Hello", "parameters": {"max_new_tokens": 11, "ignore_eos": True}}
    infer = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 11}}
    with _app_like(route_app, streamInterval=3) as client:
        assert sizes(client) == [1, 3, 3, 3, 1]
        assert sizes(client, stream_interval=2) == [1, 3, 3, 3, 1]
        assert sizes(client, stream_interval=6) == [1, 6, 4]
        # every family: Triton's stream has an event per chunk, /infer still one per token
        assert len(infer_events(client, "/v2/models/demo/generate_stream", triton)) == 5
        assert len(infer_events(client, "/infer", infer)) == 11
    assert kv_idle()


def test_completion_best_of_above_n_returns_n(client, kv_idle):
    request = {**COMPLETION, "max_tokens": 3, "n": 2, "best_of": 3, "ignore_eos": True}
    body = client.post("/v1/completions", json=request).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
    assert kv_idle()


def test_completion_beam_search_ignores_best_of(client, kv_idle):
    request = {
        **COMPLETION,
        "max_tokens": 2,
        "n": 3,
        "best_of": 1,
        "temperature": 0.5,
        "use_beam_search": True,
        "ignore_eos": True,
    }
    body = client.post("/v1/completions", json=request).json()
    assert len(body["choices"]) == 3 and body["usage"]["completion_tokens"] == 6
    assert kv_idle()


class _FailingBackend:
    """Tokenizes to three ids; generation yields one good chunk, then fails (or fails first)."""

    def __init__(self, fail_first: bool) -> None:
        self.fail_first = fail_first

    async def tokenize(self, req):
        return TokenizedPrompt([1, 2, 3], 3)

    async def unavailable(self, model):
        return None

    async def generate(self, model, req):
        if not self.fail_first:
            yield ReplicaChunk(
                req.request_id, choices=[ChoiceDelta(0, [5], "ok", num_output_tokens=1)]
            )
        yield ReplicaChunk(
            req.request_id, finished=True, error="no KV blocks", error_kind="rejected"
        )


@pytest.mark.parametrize(
    "path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_errors_before_and_after_the_stream_starts(route_app, path, base):
    with _app_like(route_app, _FailingBackend(fail_first=True)) as c:
        response = c.post(path, json={**base, "stream": True})
        assert response.status_code == 400 and response.json()["error"]["message"] == "no KV blocks"
    with _app_like(route_app, _FailingBackend(fail_first=False)) as c:
        events = sse_events(c.post(path, json={**base, "stream": True}))
        assert events[-1] == {
            "error": {
                "message": "no KV blocks",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
        assert len(events) == 2


def _histogram_sums(client, model: str = "demo") -> dict[str, float]:
    """/metrics' `<histogram>_sum` samples for the model, by histogram name."""
    sums = {}
    for line in client.get("/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.endswith(f'_sum{{model_name="{model}"}}'):
            sums[key.split("_sum{")[0]] = float(value)
    return sums


def test_a_non_stream_request_reports_its_real_time_to_first_token(client, kv_idle, paced_steps):
    """The whole answer arrives in one chunk; the time to first token is still when the first
    token came out of the engine (not when the answer came), and the time per output token the
    gaps after it. Each step takes at least 50 ms (paced_steps): the 63 decode steps after the
    first token take at least 63 x 50 ms on any machine, and that time must not be in the TTFT."""
    before = _histogram_sums(client)
    body = {"model": "demo", "prompt": "count", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
    after = _histogram_sums(client)
    rose = {name: after[name] - before.get(name, 0.0) for name in after}
    ttft, tpot, e2e = (
        rose["time_to_first_token_seconds"],
        rose["time_per_output_token_seconds"],
        rose["e2e_request_latency_seconds"],
    )
    # 63 paced decode steps come after the first token (before, the first token counted as
    # arriving with the last, so ttft was e2e and tpot ~0)
    assert ttft > 0 and e2e - ttft >= 63 * paced_steps.pace_s
    assert tpot >= paced_steps.pace_s
    assert kv_idle()
