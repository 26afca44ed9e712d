"""The shipped default model over real HTTP on Ray: SmolLM2-135M-Instruct answers like a user
expects, through each API family, with its own chat template and end-of-turn token."""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODELS_ARGS, SMOLLM2, deploy

MODEL = SMOLLM2
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# Chat samples at temperature 1 by default and its range excludes 0: top_k 1 decodes greedily.
GREEDY = {"extra_body": {"top_k": 1}}


@pytest.fixture(scope="module")
def server(cluster):
    """The app test_world_size.py tests next (left running for it): SmolLM2 among its models."""
    return deploy(cluster, MODELS_ARGS)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_chat_answers_the_question(client, kv_idle_http):
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=32, **GREEDY)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "eos_token"  # it ended its turn (<|im_end|>) by itself
    assert "<|im_end|>" not in choice.message.content
    # the prompt is the template's: its default system message, the question, the turn marks
    assert reply.usage.prompt_tokens > 30
    assert kv_idle_http()


def test_a_conversation_with_a_system_prompt_streams(client, kv_idle_http):
    messages = [
        {"role": "system", "content": "You are a helpful geography assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, stream=True, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Berlin" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "eos_token"
    assert kv_idle_http()


def test_a_stop_string_ends_the_answer_before_it(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=32, stop=["Paris"], **GREEDY
    )
    choice = reply.choices[0]
    assert "Paris" not in choice.message.content and "capital" in choice.message.content
    assert choice.finish_reason == "stop_sequence"


def test_completions_continue_the_text(client):
    reply = client.completions.create(
        model=MODEL, prompt="The capital of Germany is", max_tokens=8, temperature=0
    )
    assert "Berlin" in reply.choices[0].text
    reply = client.completions.create(
        model=MODEL, prompt="The first three letters of the alphabet are", max_tokens=12,
        temperature=0,
    )  # fmt: skip
    words = reply.choices[0].text.split()
    assert len(words) >= 3 and all(w.isprintable() for w in words)
    assert reply.choices[0].finish_reason == "length"


def test_sampled_answers_vary_and_stay_on_topic(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=24, temperature=0.7, n=3, seed=5
    )
    answers = [c.message.content for c in reply.choices]
    assert len(answers) == 3 and all(a.strip() for a in answers)


def test_triton_generate_and_mindie_infer(http):
    # both sample by default (temperature 1): do_sample false decodes greedily
    params = {"max_new_tokens": 8, "do_sample": False}
    body = {"text_input": "The capital of Germany is", "parameters": params}
    reply = http.post(f"/v2/models/{MODEL}/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert "Berlin" in reply.json()["text_output"]
    body = {"inputs": "The capital of Germany is", "parameters": params}
    reply = http.post("/infer", json={**body, "stream": False})
    assert reply.status_code == 200, reply.text
    assert "Berlin" in json.loads(reply.text)["generated_text"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def endpoints(server):
    """The Databricks OpenAI-compatible base URL, where temperature 0 is greedy."""
    import openai

    return openai.OpenAI(base_url=f"{server}/serving-endpoints", api_key="x", max_retries=0)


@pytest.mark.parametrize(
    "question, name, args",
    [("What is the weather in Paris?", "get_weather", {"city": "Paris"}),
     ("What time is it in Tokyo?", "get_time", None)],
)  # fmt: skip
def test_a_required_tool_call_picks_the_tool_and_its_arguments(endpoints, question, name, args):
    reply = endpoints.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=[WEATHER, CLOCK],
        tool_choice="required", temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == name
    got = json.loads(call.function.arguments)
    if args is not None:
        assert got == args
    else:  # the zone it names varies with the dtype (Asia/Tokyo in float32, UTC in bfloat16)
        assert isinstance(got["zone"], str) and got["zone"]


def test_json_schema_output_answers_with_the_facts(endpoints):
    person = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}  # fmt: skip
    reply = endpoints.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60,
        messages=[{"role": "user",
                   "content": "Describe a person named Alice who is 30 years old, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
    )  # fmt: skip
    assert json.loads(reply.choices[0].message.content) == {"name": "Alice", "age": 30}


def test_the_responses_api_calls_the_tool(endpoints):
    r = endpoints.responses.create(
        model=MODEL, input="What is the weather in Paris?", temperature=0,
        max_output_tokens=60, tool_choice="required",
        tools=[{"type": "function", **WEATHER["function"]}],
    )  # fmt: skip
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
