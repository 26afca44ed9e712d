"""Chat protocol without a model: request rules, the engine params a request becomes, and the
response / chunk shapes rendered from hand-made replica chunks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.messages import ChoiceDelta, ReplicaChunk, TokenizedPrompt, TokenLogprobText
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError, from_validation_errors
from serve_app.protocol.openai_chat import ChatCompletionRequest, ChatStream, chat_response
from serve_app.tokenizer.limits import TokenLimits

LIMITS = TokenLimits(max_seq_len=512, max_input_token_len=256, max_iter_times=64)
DEFAULTS = ServerDefaults(LIMITS)
BASE = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


def parse(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**BASE, **fields})


def error_of(**fields) -> APIError:
    with pytest.raises(ValidationError) as info:
        parse(**fields)
    return from_validation_errors(info.value.errors(), ())


@pytest.mark.parametrize("name", ["demo", "Qwen2.5-7B_Instruct", "a", "x" * 256])
def test_model_names_that_match_the_pattern(name):
    assert parse(model=name).model == name


@pytest.mark.parametrize("name", ["", "-demo", "demo_", ".demo", "de mo", "x" * 257, "模型"])
def test_model_names_outside_the_pattern(name):
    error = error_of(model=name)
    assert error.param == "model" and "letters, digits" in error.message


def test_content_parts_are_text_only_and_joined_for_the_size_rule():
    req = parse(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}])
    assert req.tokenize_request("demo").messages[0]["content"][1]["text"] == "a"
    error = error_of(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert error.param == "messages[0].content" and "only text parts" in error.message


def test_extra_message_keys_reach_the_chat_template():
    req = parse(messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}])
    tok = req.tokenize_request("demo")
    assert tok.kind == "chat" and tok.param == "messages"
    assert tok.messages == [{"role": "tool", "content": "42", "tool_call_id": "c1"}]


def test_messages_over_512_kb_are_refused_by_check():
    req = parse(messages=[{"role": "user", "content": "x" * (512 * 1024)}])
    req.check(pd_mode=False)  # exactly 512 KB is allowed
    req = parse(messages=[{"role": "user", "content": "x" * (512 * 1024)}] + BASE["messages"])
    with pytest.raises(APIError) as info:
        req.check(pd_mode=False)
    assert info.value.param == "messages" and "(0, 524288]" in info.value.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stop": "x"}, "stop"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 1}, "logprobs"),
    ],
)
def test_pd_mode_refuses_what_pd_cannot_run(fields, param):
    req = parse(**fields)
    req.check(pd_mode=False)
    with pytest.raises(APIError) as info:
        req.check(pd_mode=True)
    assert info.value.kind == "unsupported" and info.value.param == param
    assert "not supported in PD (inferMode dmi) mode" in info.value.message


def test_sampling_params_and_defaults():
    prompt = TokenizedPrompt([1, 2, 3], 3)
    req = parse().replica_request("r", prompt, DEFAULTS)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.n, p.best_of) == (1.0, 1.0, 0, 1, 1)
    assert p.max_tokens == 64 and p.logprobs is None and req.skip_special_tokens
    assert req.priority == 5 and req.stop == [] and req.stream is False
    req = parse(
        max_tokens=64, temperature=0.5, top_p=0.9, top_k=-1, seed=2**64 - 1, n=3,
        stop=["a", "b"], stop_token_ids=[7, 2**40, -1], logprobs=True, top_logprobs=3,
        priority=1, stream=True, skip_special_tokens=False, presence_penalty=-2,
        frequency_penalty=2, repetition_penalty=1.5, ignore_eos=True,
    ).replica_request("r", prompt, DEFAULTS)  # fmt: skip
    p = req.params
    assert p.max_tokens == 64  # maxIterTimes itself is in range
    for field in ("max_tokens", "max_completion_tokens"):  # (0, maxIterTimes]: more is refused
        with pytest.raises(
            APIError, match=rf"^{field} must be in \(0, 64\] \(maxIterTimes\), got 65$"
        ):
            parse(**{field: 65}).replica_request("r", prompt, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.n, p.best_of) == (
        0.5, 0.9, 0, 2**64 - 1, 3, 3,
    )  # fmt: skip
    assert p.stop_token_ids == [7] and p.logprobs == 3 and p.ignore_eos
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2, 2, 1.5)
    assert req.stop == ["a", "b"] and req.priority == 1 and req.stream
    assert req.logprob_texts and not req.skip_special_tokens
    assert parse(logprobs=True).replica_request("r", prompt, DEFAULTS).params.logprobs == 0
    assert (
        parse(max_completion_tokens=5).replica_request("r", prompt, DEFAULTS).params.max_tokens == 5
    )


def _delta(index=0, text="", finish=None, n=1, logprobs=None) -> ChoiceDelta:
    return ChoiceDelta(
        index=index, token_ids=[1] * bool(text), text=text, finish_reason=finish,
        num_output_tokens=n, logprobs=logprobs,
    )  # fmt: skip


def test_response_shape():
    chunk = ReplicaChunk("r", choices=[_delta(text="Hello", finish="eos", n=2)], finished=True)
    body = chat_response("chatcmpl-1", 7, "demo", chunk, 9, want_logprobs=False)
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "demo",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "finish_reason": "eos_token",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }


@pytest.mark.parametrize(
    "engine, mindie",
    [("eos", "eos_token"), ("length", "length"), ("stop_string", "stop_sequence"),
     ("stop_token", "stop_sequence"), ("aborted", "stop_sequence")],
)  # fmt: skip
def test_finish_reasons_are_mindie_words(engine, mindie):
    chunk = ReplicaChunk("r", choices=[_delta(text="x", finish=engine)], finished=True)
    assert chat_response("i", 1, "m", chunk, 1, False)["choices"][0]["finish_reason"] == mindie


def test_logprobs_have_the_openai_chat_shape():
    lp = TokenLogprobText(5, -0.5, "é", top=[(5, "é", -0.5), (6, "b", -1.0)])
    chunk = ReplicaChunk("r", choices=[_delta(text="é", finish="length", logprobs=[lp])])
    content = chat_response("i", 1, "m", chunk, 1, True)["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": "é", "logprob": -0.5, "bytes": [195, 169],
            "top_logprobs": [
                {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                {"token": "b", "logprob": -1.0, "bytes": [98]},
            ],
        }
    ]  # fmt: skip


def test_stream_chunks_have_the_role_in_every_delta_and_an_empty_final_delta():
    stream = ChatStream("id", 3, "demo", 4, want_logprobs=False, include_usage=False)
    events = stream.events(ReplicaChunk("id", choices=[_delta(text="am", n=1)]))
    events += stream.events(ReplicaChunk("id", choices=[_delta(text="", n=1)]))  # incomplete utf-8
    events += stream.events(
        ReplicaChunk("id", choices=[_delta(text=" a", finish="length", n=2)], finished=True)
    )
    head = {"id": "id", "object": "chat.completion.chunk", "created": 3, "model": "demo"}
    assert events == [
        {**head, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": "am"}, "finish_reason": None}
        ]},
        {**head, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": " a"}, "finish_reason": None}
        ]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    ]  # fmt: skip


def test_stream_usage_chunk_counts_every_choice():
    stream = ChatStream("id", 3, "demo", 4, want_logprobs=False, include_usage=True)
    stream.events(ReplicaChunk("id", choices=[_delta(0, "a", n=1), _delta(1, "b", n=1)]))
    last = stream.events(
        ReplicaChunk("id", choices=[_delta(0, "c", "eos", 2), _delta(1, "", "length", 1)],
                     finished=True)
    )  # fmt: skip
    assert [e["choices"][0]["finish_reason"] for e in last[:-1] if e["choices"]][-2:] == [
        "eos_token", "length",
    ]  # fmt: skip
    assert last[-1]["choices"] == []
    assert last[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
