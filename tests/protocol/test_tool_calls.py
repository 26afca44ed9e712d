"""Tool calls: the request rules, the replies parsed back into calls, the held-back stream, and
tools rendered for templates that know nothing of them."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from serve_app.messages import ChoiceDelta, ReplicaChunk
from serve_app.protocol.databricks_chat import DatabricksChatRequest
from serve_app.protocol.errors import APIError
from serve_app.protocol.openai_chat import ChatStream
from serve_app.protocol.sampling import openai_finish
from serve_app.protocol.tool_calls import ToolCallStream, parse_tool_calls, with_tool_calls
from serve_app.tokenizer.tools import call_text, with_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
NAMES = {"get_weather"}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _request(**fields):
    return DatabricksChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_tagged_and_bare_calls_are_parsed():
    text = f"Let me check.\n<tool_call>\n{PARIS}\n</tool_call>"
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse_tool_calls(PARIS, NAMES)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    two = f'[{PARIS}, {{"name": "get_weather", "arguments": {{}}}}]'
    assert len(parse_tool_calls(two, NAMES)[1]) == 2


@pytest.mark.parametrize(
    "text",
    ["The weather is fine.", '{"name": "other", "arguments": {}}', "<tool_call>{broken</tool_call>",
     '<tool_call>\n{"name": "get_weather"', "[]"],
)  # fmt: skip
def test_text_that_is_no_call_stays_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_response_with_a_call_finishes_with_tool_calls():
    response = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": PARIS}}]}  # fmt: skip
    choice = with_tool_calls(response, NAMES)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stream_holds_deltas_back_until_the_reply_is_whole():
    inner = ChatStream("c", 0, "m", 3, False, False, openai_finish)
    stream = ToolCallStream(inner.events, NAMES)
    parts = ['{"name": "get_weather", ', '"arguments": {"city": "Rome"}}']
    first = stream.events(ReplicaChunk("c", [ChoiceDelta(0, [1], parts[0], num_output_tokens=1)]))
    assert first == []
    last = stream.events(ReplicaChunk("c", [ChoiceDelta(
        0, [2], parts[1], finish_reason="eos", num_output_tokens=2)], finished=True))  # fmt: skip
    delta, end = last
    (call,) = delta["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert delta["choices"][0]["delta"]["content"] is None
    assert end["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tools": [WEATHER] * 2}, "tools must name each function once"),
        ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": f"f{i}"}}
                    for i in range(33)]}, "tools must have at most 32 functions, got 33"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {f"p{i}": {} for i in range(16)}}}}]},
         "must have at most 15 properties, got 16"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name must be one of the tools' names (get_weather), got 'nope'"),
        ({"tool_choice": "required"}, "tool_choice cannot be required without tools"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ],
)  # fmt: skip
def test_tool_rules(fields, message):
    with pytest.raises((APIError, ValueError)) as info:
        _request(**fields).check(False)
    assert message in str(info.value)


def test_tools_reach_the_prompt_only_when_on_offer():
    assert _request(tools=[WEATHER]).tokenize_request("m").tools[0]["function"]["name"] == (
        "get_weather"
    )
    assert _request(tools=[WEATHER], tool_choice="none").tokenize_request("m").tools is None


def test_a_template_without_tools_gets_them_in_the_system_message(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ]
    rendered, extra = with_tools(tokenizer, messages, [WEATHER])
    assert extra == {} and rendered[0]["role"] == "system"
    assert '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == call_text("get_weather", {"city": "Paris"})
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in text and "21 C" in text


def test_a_tool_call_of_unknown_shape_reaches_the_template_as_sent(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    odd = {"role": "assistant", "content": "x", "tool_calls": [{"id": "c1", "type": "function"}]}
    rendered, _ = with_tools(tokenizer, [odd], None)
    assert rendered == [odd]


@pytest.mark.parametrize(
    "text", ['{"name": ["get_weather"], "arguments": {}}', "[" * 100_000, '{"name": {}}']
)
def test_replies_that_only_look_like_calls_stay_text(text):
    assert parse_tool_calls(text, NAMES) == (text, [])
