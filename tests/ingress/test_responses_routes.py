"""The Responses API over HTTP in process (/v1/responses and /serving-endpoints/responses), with
the official openai client and raw HTTP."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}


@pytest.fixture(scope="module", params=["v1", "serving-endpoints"])
def oai(client, request):
    base = f"http://testserver/{request.param}"
    return openai.OpenAI(base_url=base, api_key="x", http_client=client)


def test_non_stream_matches_chat_greedy(oai, client, kv_idle):
    r = oai.responses.create(
        model="demo", input="hi", instructions="Be brief.", max_output_tokens=5, temperature=0,
        metadata={"user": "42"},
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.metadata == {"user": "42"}
    chat = client.post("/v1/chat/completions", json={
        "model": "demo", "max_tokens": 5, "top_k": 1, "ignore_eos": True,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "hi"}]}).json()  # fmt: skip
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert kv_idle()


def test_stream_events(oai, kv_idle):
    events = list(oai.responses.create(
        model="demo", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        max_output_tokens=4, stream=True, temperature=0, top_logprobs=2,
    ))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(d.delta for d in deltas) == done.text == events[-1].response.output_text
    assert all(len(lp.top_logprobs) == 2 for d in deltas for lp in d.logprobs)
    assert events[-1].response.usage.output_tokens == 4
    assert kv_idle()


def test_function_call_items_reach_the_model(oai):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": {"celsius": 21}},
    ]  # fmt: skip
    r = oai.responses.create(model="demo", input=items, tools=[WEATHER], max_output_tokens=3)
    assert r.status in ("completed", "incomplete") and r.tools[0].name == "get_weather"
    assert r.tool_choice == "auto"


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"background": True}, "background", "background is not supported"),
        ({"store": False}, "store", "store is not supported"),
        ({"conversation": "c1"}, "conversation", "conversation is not supported"),
        ({"service_tier": "auto"}, "service_tier", "service_tier is not supported"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning is not supported"),
        ({"temperature": 2.5}, "temperature", "temperature must be in [0.0, 2.0], got 2.5"),
        ({"top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20], got 21"),
        ({"max_output_tokens": 0}, "max_output_tokens", "must be in (0, 2147483647]"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", "input_image blocks are not supported"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", "must be message, function_call"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "is required"),
        ({"input": []}, "input", "must be a non-empty string or a non-empty list"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format.json_schema.schema", "is not a usable JSON schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "must be 'text', 'json"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only be set when"),
    ],
)  # fmt: skip
def test_refusals_name_the_parameter(client, extra, param, message):
    body = {"model": "demo", "input": "hi", **extra}
    for path in ("/v1/responses", "/serving-endpoints/responses"):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"]


def test_model_is_required_and_must_be_served(client):
    r = client.post("/v1/responses", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = client.post("/serving-endpoints/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404


def test_raw_stream_frames_carry_the_event_type(client):
    r = client.post("/v1/responses", json={"model": "demo", "input": "x", "max_output_tokens": 2,
                                           "stream": True})  # fmt: skip
    frames = [f for f in r.text.split("\n\n") if f]
    for frame in frames:
        kind, data = frame.split("\n")
        assert kind.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in r.text


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "name": "city", "schema": CITY, "strict": True},  # OpenAI's
        {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},  # Databricks'
    ],
)
def test_text_format_json_schema(client, fmt):
    schema = {**CITY, "required": ["city"]}
    fmt = json.loads(json.dumps(fmt).replace(json.dumps(CITY), json.dumps(schema)))
    body = {"model": "demo", "input": "hi", "max_output_tokens": 20, "text": {"format": fmt}}
    r = client.post("/v1/responses", json=body).json()
    text = r["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    assert r["text"]["format"]["type"] == "json_schema"


def test_forced_function_call_item(oai):
    r = oai.responses.create(model="demo", input="hi", tools=[WEATHER], max_output_tokens=30,
                             tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
