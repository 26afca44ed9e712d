"""/tokenize and /detokenize as vLLM serves them: the same ids the generation routes feed the
model (prompt and chat template alike), no length rule, token strings on request, and bad input
refused as an OpenAI error naming the field."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from serve_app.models.loader import resolve_model_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(resolve_model_path("demo-tiny")))


def test_a_prompt_is_counted_as_completions_tokenize_it(client, tokenizer):
    reply = client.post("/tokenize", json={"model": "demo", "prompt": "hello world"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids = tokenizer.encode("hello world")
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    # the completion route sees the same prompt: its usage counts as many
    usage = client.post(
        "/v1/completions", json={"model": "demo", "prompt": "hello world", "max_tokens": 1}
    )
    assert usage.json()["usage"]["prompt_tokens"] == body["count"]


def test_chat_messages_go_through_the_template_as_chat_does(client, tokenizer):
    messages = [{"role": "user", "content": "hi there"}]
    reply = client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = {"model": "demo", "messages": messages, "max_tokens": 1}
    assert (
        client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
        == (body["count"])
    )
    bare = {"messages": messages, "add_generation_prompt": False}
    assert client.post("/tokenize", json=bare).json()["count"] < body["count"]


def test_no_length_rule_applies_and_detokenize_gives_the_text_back(client, tokenizer):
    long = "word " * 400  # over maxInputTokenLen 256: a generation route refuses it
    body = client.post("/tokenize", json={"prompt": long}).json()
    assert body["count"] > 256
    refused = client.post("/v1/completions", json={"model": "demo", "prompt": long})
    assert refused.status_code == 400
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokens = [special, *tokenizer.encode("hello")]
    reply = client.post("/detokenize", json={"model": "demo", "tokens": tokens})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": "<|im_start|>hello"}  # special tokens kept


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", [1, 2], "body"),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_field(client, path, body, param):
    reply = client.post(path, json=body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == reply.status_code
