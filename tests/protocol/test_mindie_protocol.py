"""/infer and /infer_token request rules, response and SSE shapes; no model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.messages import ChoiceDelta, ReplicaChunk, StepInfo
from serve_app.protocol.errors import APIError, from_validation_errors
from serve_app.protocol.mindie import InferRequest, InferStream, infer_response, max_new_tokens

U64 = 18446744073709551615
I32 = 2147483647

# (parameter, bad value, words the message must contain)
BAD_PARAMETERS = [
    ("temperature", 0.0, "must be > 0.0"),
    ("temperature", -0.5, "must be > 0.0"),
    ("temperature", "0.5", "valid number"),
    ("top_k", 0, "in (0, 2147483647]"),
    ("top_k", I32 + 1, "in (0, 2147483647]"),
    ("top_k", 1.5, "valid integer"),
    ("top_p", 0.0, "in (0.0, 1.0)"),
    ("top_p", 1.0, "in (0.0, 1.0)"),  # absent means 1.0, an explicit 1.0 is refused
    ("top_p", 1.5, "in (0.0, 1.0)"),
    ("max_new_tokens", 0, "in (0, 2147483647]"),
    ("max_new_tokens", I32 + 1, "in (0, 2147483647]"),
    ("max_new_tokens", True, "valid integer"),
    ("do_sample", "true", "valid boolean"),
    ("seed", 0, "in (0, 18446744073709551615]"),
    ("seed", U64 + 1, "in (0, 18446744073709551615]"),
    ("seed", -3, "in (0, 18446744073709551615]"),
    ("repetition_penalty", 0.0, "must be > 0.0"),
    ("repetition_penalty", -1, "must be > 0.0"),
    ("details", 1, "valid boolean"),
    ("typical_p", 0.0, "in (0.0, 1.0]"),
    ("typical_p", 1.01, "in (0.0, 1.0]"),
    ("watermark", "no", "valid boolean"),
    ("priority", 0, "in [1, 5]"),
    ("priority", 6, "in [1, 5]"),
    ("priority", 2.5, "valid integer"),
    ("timeout", 0, "in (0, 3600]"),
    ("timeout", 3601, "in (0, 3600]"),
    ("timeout", float("nan"), "in (0, 3600]"),
]

GOOD_PARAMETERS = [
    ("temperature", 1e-6),
    ("temperature", 5),  # no upper bound on /infer
    ("top_k", 1),
    ("top_k", I32),
    ("top_p", 0.999),
    ("max_new_tokens", I32),
    ("seed", 1),
    ("seed", U64),
    ("repetition_penalty", 0.5),
    ("typical_p", 1.0),
    ("watermark", True),
    ("priority", 1),
    ("priority", 5),
    ("timeout", 3600),
    ("timeout", 0.05),
    ("seed", None),
]


def message_for(body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        InferRequest.model_validate(body)
    return from_validation_errors(caught.value.errors()).message


@pytest.mark.parametrize(("name", "value", "words"), BAD_PARAMETERS)
def test_bad_parameter_message_names_it_and_its_range(name, value, words):
    message = message_for({"inputs": "hi", "parameters": {name: value}})
    assert message.startswith(f"parameters.{name} ")
    assert words in message


@pytest.mark.parametrize(("name", "value"), GOOD_PARAMETERS)
def test_good_parameter_accepted(name, value):
    req = InferRequest.model_validate({"input_id": [1, 2], "parameters": {name: value}})
    assert getattr(req.params, name) == value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": 5}, "inputs"),
        ({"input_id": "1 2"}, "input_id"),
        ({"input_id": [1, "2"]}, "input_id[1]"),
        ({"input_id": [True]}, "input_id[0]"),
        ({"inputs": "x", "stream": "yes"}, "stream"),
        ({"inputs": "x", "parameters": []}, "parameters"),
    ],
)
def test_bad_prompt_and_stream_types(body, field):
    assert message_for(body).startswith(f"{field} ")


def test_documented_example_is_valid_and_defaults():
    body = {
        "input_id": [5618, 19678, 701, 9072, 13],
        "stream": False,
        "parameters": {
            "temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20,
            "do_sample": True, "seed": None, "repetition_penalty": 1.03, "details": True,
            "typical_p": 0.5, "watermark": False, "priority": 5, "timeout": 10,
        },
    }  # fmt: skip
    req = InferRequest.model_validate(body)
    assert req.prompt("input_id") == ("input_id", [5618, 19678, 701, 9072, 13])
    assert 1 <= req.seed() <= U64  # absent seed: drawn by the server
    assert max_new_tokens(InferRequest.model_validate({"inputs": "x"}).params) == 20
    assert InferRequest.model_validate({"inputs": "x", "parameters": {"seed": 7}}).seed() == 7


def test_prompt_rules():
    both = InferRequest.model_validate({"inputs": "x", "input_id": [1]})
    with pytest.raises(APIError) as caught:
        both.prompt("inputs")
    assert caught.value.message.startswith("Input conflict.")
    assert "inputs" in caught.value.message and "input_id" in caught.value.message
    for primary in ("inputs", "input_id"):
        with pytest.raises(APIError) as caught:
            InferRequest.model_validate({}).prompt(primary)
        assert caught.value.kind == "validation"
        assert caught.value.message.startswith(f"{primary} is required")
    # each route takes either field
    assert InferRequest.model_validate({"inputs": "x"}).prompt("input_id") == ("inputs", "x")


def _chunk(ids, texts, finished=False, reason=None, first=False):
    steps = [
        StepInfo(1, 5.0, 12.345 if first and i == 0 else None, None if first and i == 0 else 3.3)
        for i in range(len(ids))
    ]
    delta = ChoiceDelta(
        index=0, token_ids=ids, text="".join(texts), token_texts=texts, finish_reason=reason
    )
    return ReplicaChunk("r", choices=[delta], steps=steps, finished=finished)


def test_stream_events_follow_the_documented_shape():
    stream = InferStream(seed=99, with_details=True)
    events = stream.payloads(_chunk([10, 11], ["a", " b"], first=True))
    events += stream.payloads(_chunk([12, 13], [" c", " d"], finished=True, reason="length"))
    assert events[0] == {
        "prefill_time": 12.35,
        "decode_time": None,
        "token": {"id": 10, "text": "a"},
    }
    assert events[1] == {
        "prefill_time": None,
        "decode_time": 3.3,
        "token": {"id": 11, "text": " b"},
    }
    assert events[2]["token"] == {"id": 12, "text": " c"}
    assert events[-1] == {
        "prefill_time": None,
        "decode_time": 3.3,
        "generated_text": "a b c d",
        "details": {"finish_reason": "length", "generated_tokens": 4, "seed": 99},
        "token": {"id": 13, "text": None},
    }
    assert len(events) == 4  # one event per token; the last token's text only in generated_text


def test_stream_full_text_and_no_details():
    stream = InferStream(seed=1, with_details=False, full_text=True)
    events = stream.payloads(_chunk([1, 2, 3], ["x", "y", "z"], finished=True, reason="eos"))
    assert [e["token"]["text"] for e in events[:2]] == ["x", "xy"]
    assert "details" not in events[-1] and events[-1]["generated_text"] == "xyz"


def test_stream_stopped_after_last_token_event():
    stream = InferStream(seed=1, with_details=True)
    stream.payloads(_chunk([1], ["x"], first=True))
    stopped = ReplicaChunk(
        "r", choices=[ChoiceDelta(0, [], "", finish_reason="aborted")], finished=True
    )
    (last,) = stream.payloads(stopped)
    assert last["token"] is None and last["generated_text"] == "x"
    assert last["details"]["finish_reason"] == "stop_sequence"


def test_non_stream_body():
    chunk = _chunk([1, 2], ["he", "y"], finished=True, reason="eos")
    chunk.choices[0].num_output_tokens = 2
    assert infer_response(chunk, 5, False) == {"generated_text": "hey"}
    assert infer_response(chunk, 5, True)["details"] == {
        "finish_reason": "eos_token",
        "generated_tokens": 2,
        "seed": 5,
    }
