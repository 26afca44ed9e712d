"""The Databricks family over HTTP in process: /serving-endpoints/{name}/invocations for chat and
completions, the OpenAI-compatible paths under /serving-endpoints/, the endpoint listing, and
errors in each path's shape."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.stepping import Stepping

INVOKE = "/serving-endpoints/demo/invocations"
HI = [{"role": "user", "content": "hi"}]


def _events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_endpoints_are_listed_in_databricks_shape(client):
    listed = client.get("/api/2.0/serving-endpoints").json()["endpoints"]
    assert [(e["name"], e["task"], e["state"]["ready"]) for e in listed] == [
        ("demo", "llm/v1/chat", "READY"), ("minilm", "llm/v1/embeddings", "READY")
    ]  # fmt: skip
    assert client.get("/api/2.0/serving-endpoints/demo").json()["name"] == "demo"
    missing = client.get("/api/2.0/serving-endpoints/nope")
    assert missing.status_code == 404
    assert missing.json() == {
        "error_code": "RESOURCE_DOES_NOT_EXIST",
        "message": "endpoint 'nope' does not exist; endpoints: demo, minilm",
    }


def test_chat_invocation(client, kv_idle):
    r = client.post(INVOKE, json={"messages": HI, "max_tokens": 4})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    # sampled (temperature 1 by default): the random model may end early with its EOS
    finished = {"length": 4, "stop": body["usage"]["completion_tokens"]}
    assert body["usage"]["completion_tokens"] == finished[choice["finish_reason"]] <= 4
    assert body["usage"]["prompt_tokens"] == 9
    # temperature 0 and top_k 1 are both greedy: the same reply
    greedy = [
        client.post(INVOKE, json={"messages": HI, "max_tokens": 6, **extra}).json()
        for extra in ({"temperature": 0}, {"top_k": 1}, {"temperature": 0})
    ]
    texts = {g["choices"][0]["message"]["content"] for g in greedy}
    assert len(texts) == 1
    assert kv_idle()


def test_chat_stream_and_usage(client, kv_idle):
    r = client.post(
        INVOKE,
        json={"messages": HI, "max_tokens": 4, "n": 2, "stream": True, "temperature": 0,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = _events(r)
    assert r.headers["content-type"].startswith("text/event-stream")
    firsts = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        firsts.setdefault(choice["index"], choice)
    assert all(c["delta"]["role"] == "assistant" for c in firsts.values())
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes.count("length") == 2 and finishes[-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert kv_idle()


def test_chat_logprobs(client):
    body = client.post(
        INVOKE, json={"messages": HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 20}
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(t["top_logprobs"]) == 20 for t in content)
    r = client.post(INVOKE, json={"messages": HI, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and "top_logprobs must be in [0, 20], got 21" in r.text


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
         "messages[1].role system can only be the first message"),
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id is required"),
        ([{"role": "user", "content": "a", "tool_call_id": "x"}],
         "messages[0].tool_call_id must be empty when role is user"),
        ([{"role": "user", "content": "a",
           "tool_calls": [{"id": "1", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}]}],
         "messages[0].tool_calls can only be set when role is assistant"),
        ([{"role": "assistant"}], "messages[0].content is required for a assistant message"),
        ([], "messages must be a non-empty list of messages"),
    ],
)  # fmt: skip
def test_chat_message_rules(client, messages, message):
    r = client.post(INVOKE, json={"messages": messages})
    assert r.status_code == 400
    assert r.json()["error_code"] == "BAD_REQUEST" and message in r.json()["message"]


def test_assistant_tool_calls_and_tool_results_reach_the_template(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    r = client.post(INVOKE, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"temperature": 2.5}, "temperature must be in [0.0, 2.0], got 2.5"),
        ({"top_p": 0}, "top_p must be in (0.0, 1.0], got 0"),
        ({"top_k": 0}, "top_k must be in (0, 2147483647], got 0"),
        ({"max_tokens": 0}, "max_tokens must be in (0, 2147483647], got 0"),
        ({"n": 0}, "n must be in [1, 128], got 0"),
        ({"reasoning_effort": "high"}, "reasoning_effort is only accepted by reasoning models"),
        ({"stream_options": {"include_usage": True}}, "stream_options can only be set when"),
    ],
)  # fmt: skip
def test_out_of_range_is_400_naming_the_parameter(client, extra, message):
    r = client.post(INVOKE, json={"messages": HI, **extra})
    assert r.status_code == 400 and r.json()["error_code"] == "BAD_REQUEST"
    assert message in r.json()["message"]
    r = client.post(INVOKE, json={"prompt": "x", **extra})
    assert r.status_code == 400 and message in r.json()["message"]


def test_invocation_errors(client):
    r = client.post("/serving-endpoints/nope/invocations", json={"prompt": "x"})
    assert r.status_code == 404 and r.json()["error_code"] == "RESOURCE_DOES_NOT_EXIST"
    r = client.post(INVOKE, json={"text": "x"})
    assert r.status_code == 400 and "body must have messages (chat), prompt" in r.text
    r = client.post(INVOKE, content=b"{not json")
    assert r.status_code == 400 and r.json()["message"].startswith("body is not valid JSON")
    r = client.post(INVOKE, json=["prompt"])
    assert r.json() == {"error_code": "BAD_REQUEST", "message": "body must be a JSON object"}


def test_completions_batch_n_echo_suffix(client, kv_idle):
    body = client.post(
        INVOKE,
        json={"prompt": ["one", "two words"], "max_tokens": 3, "n": 2, "echo": True,
              "suffix": "<end>", "temperature": 0},
    ).json()  # fmt: skip
    assert body["object"] == "text_completion"
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"].startswith("one") and choices[2]["text"].startswith("two words")
    assert all(c["text"].endswith("<end>") and c["finish_reason"] == "length" for c in choices)
    assert choices[0]["text"] == choices[1]["text"]  # greedy: n equal choices
    assert body["usage"]["completion_tokens"] == 12
    assert kv_idle()


def test_completions_raw_prompt_skips_the_template(client):
    def prompt_tokens(**extra) -> int:
        r = client.post(INVOKE, json={"prompt": "hello", "max_tokens": 1, **extra})
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(use_raw_prompt=True) == 1
    assert prompt_tokens() > 1  # the chat template's tokens are counted


def test_completions_stream_batch(client, kv_idle):
    r = client.post(
        INVOKE,
        json={"prompt": ["a", "b"], "max_tokens": 3, "stream": True, "temperature": 0,
              "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = _events(r)
    texts: dict[int, str] = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1]
    assert events[-1]["usage"]["completion_tokens"] == 6
    whole = client.post(
        INVOKE, json={"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0}
    ).json()
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]
    assert kv_idle()


def test_completions_error_behavior_on_a_long_prompt(client):
    long = "word " * 400  # over maxInputTokenLen (256)
    r = client.post(INVOKE, json={"prompt": ["ok", long], "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["message"].startswith("prompt[1] must have between 1 and 256 tokens")
    r = client.post(
        INVOKE, json={"prompt": ["ok", long], "max_tokens": 2, "error_behavior": "truncate"}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = client.post(INVOKE, json={"prompt": "x", "error_behavior": "ignore"})
    assert r.status_code == 400 and "error_behavior" in r.json()["message"]


def test_openai_compatible_paths(client, kv_idle):
    oai = openai.OpenAI(
        base_url="http://testserver/serving-endpoints", api_key="x", http_client=client
    )
    reply = oai.chat.completions.create(model="demo", messages=HI, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    stream = oai.chat.completions.create(
        model="demo", messages=HI, max_tokens=3, temperature=0, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    done = oai.completions.create(model="demo", prompt=["x", "y"], max_tokens=2)
    assert len(done.choices) == 2
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=HI)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="demo", messages=HI, temperature=3)
    assert info.value.body["param"] == "temperature"  # OpenAI's error shape on these paths
    r = client.post("/serving-endpoints/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert kv_idle()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}},
}]  # fmt: skip


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "address"],
}  # fmt: skip


# Each path once, and each budget once (24: close to the shortest output; 60: room to spare):
# how the grammar closes the output within a budget is the engine's, the same under both paths.
@pytest.mark.parametrize(
    "path, max_tokens", [(INVOKE, 24), ("/serving-endpoints/chat/completions", 60)]
)
def test_json_schema_output_validates_even_from_the_random_model(client, path, max_tokens):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"model": "demo", "messages": HI, "max_tokens": max_tokens, "n": 2,
            "response_format": fmt}  # fmt: skip
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_output_and_stream(client, kv_idle):
    body = {"messages": HI, "max_tokens": 20, "response_format": {"type": "json_object"}}
    reply = client.post(INVOKE, json=body).json()["choices"][0]["message"]["content"]
    assert isinstance(json.loads(reply), dict)
    events = _events(client.post(INVOKE, json={**body, "stream": True}))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert isinstance(json.loads(text), dict)
    assert kv_idle()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_call_is_a_valid_call(client, choice):
    other = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    }
    body = {"messages": HI, "max_tokens": 30, "tools": [*TOOLS, other], "tool_choice": choice}
    for stream in (False, True):
        r = client.post(INVOKE, json={**body, "stream": stream})
        if stream:
            events = _events(r)
            (call,) = next(e for e in events if e["choices"][0]["delta"].get("tool_calls"))[
                "choices"
            ][0]["delta"]["tool_calls"]
            assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            choice_out = r.json()["choices"][0]
            assert choice_out["finish_reason"] == "tool_calls"
            (call,) = choice_out["message"]["tool_calls"]
        name = call["function"]["name"]
        assert name in ("get_weather", "get_time") and call["id"].startswith("call_")
        if isinstance(choice, dict):
            assert name == "get_weather"
        arguments = json.loads(call["function"]["arguments"])
        schema = (TOOLS[0] if name == "get_weather" else other)["function"]["parameters"]
        jsonschema.validate(arguments, schema)


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema", "is not a usable JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop",
         "cannot be used with JSON output"),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
         "response_format", "cannot ask for JSON output while tool_choice forces"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                      "schema": PERSON}},
          "max_tokens": 3}, None, "below the"),
    ],
)  # fmt: skip
def test_unusable_output_formats_are_400(client, extra, param, message):
    body = {"model": "demo", "messages": HI, **extra}
    r = client.post("/serving-endpoints/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_tools_auto_and_text_format_run(client, kv_idle):
    for extra in ({"tools": TOOLS}, {"tools": TOOLS, "stream": True},
                  {"response_format": {"type": "text"}}):  # fmt: skip
        r = client.post(INVOKE, json={"messages": HI, "max_tokens": 3, **extra})
        assert r.status_code == 200, r.text
    assert kv_idle()


def test_openai_client_tools_with_each_tool_choice_and_json_schema(client, kv_idle):
    oai = openai.OpenAI(
        base_url="http://testserver/serving-endpoints", api_key="x", http_client=client
    )
    params = TOOLS[0]["function"]["parameters"]
    for choice in ("auto", "none", "required",
                   {"type": "function", "function": {"name": "get_weather"}}):  # fmt: skip
        reply = oai.chat.completions.create(
            model="demo", messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=30
        )
        message = reply.choices[0].message
        if choice in ("auto", "none"):  # the random model writes text
            assert message.tool_calls is None and reply.choices[0].finish_reason != "tool_calls"
        else:
            assert reply.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), params)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for stream in (False, True):
        reply = oai.chat.completions.create(
            model="demo", messages=HI, max_tokens=40, response_format=fmt, stream=stream,
            logprobs=True, top_logprobs=2,
        )  # fmt: skip
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            text = reply.choices[0].message.content
            assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
        jsonschema.validate(json.loads(text), PERSON)
    assert kv_idle()


@pytest.fixture
def short_timeout(monkeypatch):
    """Databricks requests carry no timeout of their own: give each prompt 0.3 s."""
    from dataclasses import replace

    from serve_app.protocol import databricks_completions

    original = databricks_completions.OnePrompt.replica_request

    def with_timeout(self, *args, **kwargs):
        return replace(original(self, *args, **kwargs), timeout_s=0.3)

    monkeypatch.setattr(databricks_completions.OnePrompt, "replica_request", with_timeout)


# The route app's maxIterTimes. With each engine step paced to at least PACE_S (tests/stepping.py)
# a prompt of that many tokens takes 2.56 s, so it cannot end inside the 0.3 s timeout on any
# machine (unpaced, it could on a fast one, and then nothing timed out).
MAX_TOKENS, PACE_S = 64, 0.04


def test_truncate_returns_what_a_timed_out_prompt_generated(
    client, kv_idle, short_timeout, monkeypatch
):
    stepping = Stepping(client.app.state.replica.engine.engine, monkeypatch, pace_s=PACE_S)
    body = {"prompt": ["a long story", "another"], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post(INVOKE, json=body)
    assert r.status_code == 504 and r.json()["error_code"] == "DEADLINE_EXCEEDED"
    out = client.post(INVOKE, json={**body, "error_behavior": "truncate"}).json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    generated = out["usage"]["completion_tokens"]
    assert 0 < generated < 2 * MAX_TOKENS and out["usage"]["prompt_tokens"] > 2
    assert all(c["text"] for c in out["choices"])
    events = _events(client.post(INVOKE, json={**body, "error_behavior": "truncate",
                                               "stream": True}))  # fmt: skip
    ends = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in ends) == [0, 1]
    assert {c["finish_reason"] for c in ends} == {"length"}
    # idle after fewer steps in all than one prompt's MAX_TOKENS: the timed-out prompts were
    # aborted, not left to run to their end
    assert kv_idle() and stepping.steps < MAX_TOKENS


def test_json_nested_past_the_recursion_limit_is_bad_input(client):
    deep = "[" * 100_000
    r = client.post(INVOKE, content=deep.encode())
    assert r.status_code == 400 and r.json()["message"].startswith("body is not valid JSON")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    assert client.post(INVOKE, json={"messages": messages, "max_tokens": 1}).status_code < 500
    fmt = {"type": "json_schema", "name": "x", "schema": deep}
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "text": {"format": fmt}})
    assert r.status_code == 400
