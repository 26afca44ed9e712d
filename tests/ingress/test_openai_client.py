"""The official `openai` Python client against the in-process app: the Starlette TestClient is
an httpx.Client, so it is the client's transport and no port is opened."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def test_chat_non_stream_and_stream(oai, kv_idle):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    reply = oai.chat.completions.create(
        model="demo", messages=messages, max_tokens=5, seed=3, temperature=0.5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"  # MindIE's word (chat)
    assert reply.usage.completion_tokens == 5
    chunks = list(
        oai.chat.completions.create(
            model="demo", messages=messages, max_tokens=5, seed=3, temperature=0.5, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert kv_idle()


def test_completions_non_stream_and_stream(oai, kv_idle):
    reply = oai.completions.create(
        model="demo", prompt="who are you", max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert len(reply.choices[0].logprobs.tokens) == 4
    assert reply.usage.completion_tokens == 4
    chunks = list(
        oai.completions.create(
            model="demo", prompt="who are you", max_tokens=4, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4
    assert kv_idle()


def test_stream_interval_through_extra_body(oai, kv_idle):
    """vLLM's stream_interval as the README shows it: 9 tokens in chunks of 1, 4 and 4."""
    chunks = list(
        oai.completions.create(
            model="demo", prompt="who are you", max_tokens=9, temperature=0, stream=True,
            logprobs=0, extra_body={"ignore_eos": True, "stream_interval": 4},
        )
    )  # fmt: skip
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices]
    assert sizes == [1, 4, 4] and chunks[-1].usage.completion_tokens == 9
    assert kv_idle()


def test_errors_raise_the_clients_exceptions(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], temperature=3
        )
    assert "temperature" in str(info.value) and info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi")
