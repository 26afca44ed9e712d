"""Triton generate request rules (MindIE's ranges) and response shapes, no model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.messages import ChoiceDelta, ReplicaChunk, StepInfo
from serve_app.protocol.errors import APIError, from_validation_errors
from serve_app.protocol.triton import GenerateRequest, GenerateStream, Head, generate_response

U64 = 18446744073709551615
I32 = 2147483647

BAD_PARAMETERS = [
    ("temperature", -0.1, "must be >= 0.0"),
    ("temperature", "1", "valid number"),
    ("max_tokens", 0, "in (0, 2147483647]"),
    ("max_tokens", I32 + 1, "in (0, 2147483647]"),
    ("max_new_tokens", 0, "in (0, 2147483647]"),
    ("max_new_tokens", 2.0, "valid integer"),
    ("top_k", 0, "in (0, 2147483647]"),
    ("top_k", I32 + 1, "in (0, 2147483647]"),
    ("top_p", 0.0, "in (0.0, 1.0]"),
    ("top_p", 1.1, "in (0.0, 1.0]"),
    ("do_sample", "false", "valid boolean"),
    ("seed", 0, "in (0, 18446744073709551615]"),
    ("seed", U64 + 1, "in (0, 18446744073709551615]"),
    ("repetition_penalty", 0, "must be > 0.0"),
    ("typical_p", 0, "in (0.0, 1.0]"),
    ("typical_p", 2, "in (0.0, 1.0]"),
    ("watermark", 0, "valid boolean"),
    ("details", "true", "valid boolean"),
    ("batch_size", 0, "in [1, 2147483647]"),
    ("perf_stat", 1, "valid boolean"),
    ("priority", 0, "in [1, 5]"),
    ("priority", 6, "in [1, 5]"),
    ("timeout", 0, "in (0, 3600]"),
    ("timeout", 4000, "in (0, 3600]"),
    ("stream", "yes", "valid boolean"),
    ("stop", "", "non-empty string"),
    ("stop", ["ok", ""], "non-empty string"),
    ("stop", ["a" * 20000, "b" * 20000], "at most 32768 characters"),
    ("stop", 5, "a string or a list of strings"),
    ("stop", ["a", 1], "a string or a list of strings"),
]

GOOD_PARAMETERS = [
    ("temperature", 0),  # as in Triton's own example: 0 means greedy
    ("temperature", 1.7),
    ("top_p", 1.0),
    ("top_k", I32),
    ("seed", U64),
    ("max_tokens", 1),
    ("max_new_tokens", I32),
    ("priority", 1),
    ("timeout", 0.01),
    ("stop", "x" * 32768),
    ("stop", ["a", "b"]),
    ("batch_size", 100),
]


def message_for(body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        GenerateRequest.model_validate(body)
    return from_validation_errors(caught.value.errors()).message


BAD_PARAMETERS += [
    ("stop_words", 5, "a string or a list of strings"),
    ("stop_words", ["a" * 20000, "b" * 20000], "at most 32768 characters"),
    ("bad_words", ["a", None], "a string or a list of strings"),
]
GOOD_PARAMETERS += [("stop_words", ["a", "b"]), ("bad_words", ["x y"])]


@pytest.mark.parametrize(("name", "value", "words"), BAD_PARAMETERS)
def test_bad_parameter_message_names_it_and_its_range(name, value, words):
    message = message_for({"text_input": "hi", "parameters": {name: value}})
    assert message.startswith(f"parameters.{name} ")
    assert words in message


@pytest.mark.parametrize(("name", "value", "words"), BAD_PARAMETERS)
def test_a_top_level_parameter_has_the_same_rules_and_is_named_as_sent(name, value, words):
    """Triton passes any other attribute of the request on as a parameter (TensorRT-LLM's
    clients send them so): the same ranges, the error names the top-level field."""
    message = message_for({"text_input": "hi", name: value})
    assert message.startswith(f"{name} ")
    assert words in message


@pytest.mark.parametrize(("name", "value"), GOOD_PARAMETERS)
def test_good_parameter_accepted(name, value):
    req = GenerateRequest.model_validate({"text_input": "x", "parameters": {name: value}})
    assert getattr(req.params, name) == value
    top = GenerateRequest.model_validate({"text_input": "x", name: value})
    assert getattr(top.params, name) == value


def test_a_tensorrt_llm_body_sets_its_parameters():
    body = {"text_input": "What is ML?", "max_tokens": 7, "temperature": 0, "bad_words": "",
            "stop_words": "", "stream": False, "end_id": 2, "pad_id": 2}  # fmt: skip
    params = GenerateRequest.model_validate(body).params
    assert params.output_tokens() == 7 and params.temperature == 0
    assert params.bad_words is None and params.stop_list == []  # "" means none


def test_stop_words_add_stop_strings_and_empty_ones_mean_none():
    def params(**fields):
        return GenerateRequest.model_validate({"text_input": "x", **fields}).params

    assert params(stop_words=["a", "", "b"]).stop_list == ["a", "b"]
    assert params(stop="a", stop_words="b", parameters={"stop_words": "b"}).stop_list == ["a", "b"]
    assert params(stop_words=[""]).stop_words is None
    assert params(bad_words=["", "bad"]).bad_words == ["bad"]


@pytest.mark.parametrize(
    ("top", "nested"),
    [({"max_tokens": 5}, {"max_tokens": 6}), ({"temperature": 0}, {"temperature": 1.0}),
     ({"bad_words": "a"}, {"bad_words": ["b"]}), ({"stream": True}, {"stream": False})],
)  # fmt: skip
def test_a_parameter_given_twice_must_agree(top, nested):
    name = next(iter(top))
    agreeing = GenerateRequest.model_validate({"text_input": "x", **top, "parameters": top})
    assert getattr(agreeing.params, name) == getattr(
        GenerateRequest.model_validate({"text_input": "x", **top}).params, name
    )
    req = GenerateRequest.model_validate({"text_input": "x", **top, "parameters": nested})
    with pytest.raises(APIError) as caught:
        req.check(pd_mode=False)
    assert caught.value.param == name
    assert f"{name} (" in caught.value.message and f"parameters.{name} (" in caught.value.message


def test_a_top_level_parameter_joins_the_nested_ones():
    body = {"text_input": "x", "max_tokens": 3, "parameters": {"temperature": 0, "seed": 5}}
    params = GenerateRequest.model_validate(body).params
    assert (params.output_tokens(), params.temperature, params.seed) == (3, 0, 5)


@pytest.mark.parametrize("request_id", ["", "a b", "a.b:c", "a" * 300, "中文 id/\\x"])
def test_any_string_is_an_id(request_id):
    assert GenerateRequest.model_validate({"text_input": "x", "id": request_id}).id == request_id


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "text_input"),
        ({"text_input": 3}, "text_input"),
        ({"text_input": "x", "id": 42}, "id"),
        ({"text_input": "x", "id": ["a"]}, "id"),
    ],
)
def test_bad_body_fields(body, field):
    assert message_for(body).startswith(f"{field} ")


def test_documented_example_and_ignored_parameters():
    body = {
        "id": "42",
        "text_input": "client input",
        "parameters": {"stream": False, "temperature": 0},
    }
    req = GenerateRequest.model_validate({**body, "extra": 1})
    assert req.id == "42" and req.params.temperature == 0
    unknown = GenerateRequest.model_validate({"text_input": "x", "parameters": {"foo": [1]}})
    assert unknown.params.output_tokens() == 20  # the default


def test_max_tokens_aliases():
    def tokens(**params):
        return GenerateRequest.model_validate({"text_input": "x", "parameters": params}).params

    assert tokens(max_tokens=7).output_tokens() == 7
    assert tokens(max_new_tokens=9).output_tokens() == 9
    assert tokens(max_tokens=5, max_new_tokens=5).output_tokens() == 5
    with pytest.raises(APIError) as caught:
        tokens(max_tokens=5, max_new_tokens=6).output_tokens()
    assert "max_tokens" in caught.value.message and "max_new_tokens" in caught.value.message
    assert tokens(stop="x").stop_list == ["x"] and tokens().stop_list == []


def _chunk(text, ids, finished=False, reason=None, steps=()):
    delta = ChoiceDelta(0, ids, text, finish_reason=reason, num_output_tokens=len(ids))
    return ReplicaChunk("r", choices=[delta], steps=list(steps), finished=finished)


STEPS = [StepInfo(2, 10.0, prefill_time_ms=5.556), StepInfo(3, 1.0, decode_time_ms=2.0)]


def test_response_shape():
    head = Head("42", "demo", "1")
    chunk = _chunk("out", [1, 2], finished=True, reason="length", steps=STEPS)
    assert generate_response(head, chunk, False) == {
        "id": "42", "model_name": "demo", "model_version": "1", "text_output": "out",
    }  # fmt: skip
    assert generate_response(head, chunk, True)["details"] == {
        "finish_reason": "length",
        "generated_tokens": 2,
        "first_token_cost": 5.56,
        "decode_cost": [2.0],
        "batch_size": [2, 3],
        "queue_wait_time": [10.0, 1.0],
    }
    assert "id" not in generate_response(Head(None, "demo", "1"), chunk, False)


def test_stream_events_carry_deltas_and_details_last():
    stream = GenerateStream(Head(None, "demo", "1"), with_details=True)
    first = stream.payload(_chunk("a", [1], steps=STEPS[:1]))
    assert first == {"model_name": "demo", "model_version": "1", "text_output": "a"}
    assert stream.payload(_chunk("", [])) is None  # nothing new: no event
    last = stream.payload(_chunk("b", [2], finished=True, reason="stop_string", steps=STEPS[1:]))
    assert last["text_output"] == "b"
    assert last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["batch_size"] == [2, 3]


@pytest.mark.parametrize(
    "fields", [{"stop_words": "x"}, {"parameters": {"stop_words": ["x"]}}, {"stop": "x"}]
)
def test_stop_strings_are_refused_in_pd(fields):
    req = GenerateRequest.model_validate({"text_input": "x", **fields})
    req.check(pd_mode=False)
    with pytest.raises(APIError) as caught:
        req.check(pd_mode=True)
    assert caught.value.param == ("stop" if "stop" in fields else "stop_words")
