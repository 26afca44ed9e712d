"""The spec side of structured output: OpenAI's response_format in, a picklable constraint out,
and clear refusals naming the field at fault. No model needed."""

import json
import pickle

import pytest
from structured_helpers import PERSON

from serve_app.engine import SamplingParams
from serve_app.structured import (
    JsonConstraint,
    ResponseFormatError,
    from_response_format,
    json_object,
    json_schema,
    tool_call_schema,
)
from serve_app.structured.grammars import clean_message
from serve_app.structured.json_lexer import JsonLexer


def test_text_and_no_format_need_no_constraint():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None


def test_json_object_and_json_schema():
    assert from_response_format({"type": "json_object"}) == JsonConstraint("json_object")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    constraint = from_response_format(fmt)
    assert constraint.kind == "json_schema"
    assert json.loads(constraint.schema_json) == PERSON
    assert list(json.loads(constraint.schema_json)["properties"]) == ["name", "age"]  # order kept
    # a schema given as a JSON string is the same constraint (the grammar cache key)
    assert json_schema(json.dumps(PERSON, indent=2)) == constraint


def test_the_constraint_pickles_with_its_params():
    params = SamplingParams(n=2, constraint=json_schema(PERSON))
    again = pickle.loads(pickle.dumps(params))
    assert again.constraint == params.constraint
    assert pickle.loads(pickle.dumps(json_object())) == json_object()


@pytest.mark.parametrize(
    "fmt, param, words",
    [
        ({"type": "xml"}, "response_format.type", "must be text, json_object or json_schema"),
        ({"type": "json_schema"}, "response_format.json_schema", "is required"),
        ({"type": "json_schema", "json_schema": {"name": "x"}},
         "response_format.json_schema.schema", "is required"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}},
         "response_format.json_schema.schema", "is not valid JSON"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
         "response_format.json_schema.schema", "must be a JSON object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
         "response_format.json_schema.schema", 'Unsupported type "objekt"'),
        ({"type": "json_schema",
          "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
         "response_format.json_schema.schema", "is not a usable JSON schema"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(fmt, param, words):
    with pytest.raises(ResponseFormatError) as caught:
        from_response_format(fmt)
    assert caught.value.param == param
    assert words in caught.value.message
    assert "/project/" not in caught.value.message and "JSON string is" not in str(caught.value)


def test_xgrammar_messages_lose_their_log_prefix():
    raw = '[15:23:13] /project/cpp/json_schema_converter.cc:4944: Unsupported type "objekt"'
    assert clean_message(raw) == 'Unsupported type "objekt"'


def test_tool_call_schema_one_or_any_of_several():
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    one = tool_call_schema([weather])
    assert one["properties"]["name"] == {"const": "get_weather"}
    assert one["required"] == ["name", "arguments"]
    several = tool_call_schema([weather, {"name": "now"}], parallel=True)
    assert several["type"] == "array" and len(several["items"]["anyOf"]) == 2
    assert several["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    json_schema(several)  # xgrammar takes it
    with pytest.raises(ValueError, match="name"):
        tool_call_schema([{"type": "function", "function": {}}])


@pytest.mark.parametrize(
    "text, closing",
    [
        ('{"a": [1, {"b": "x', b'"}]}'),
        ('{"a": "}]\\"', b'"}'),  # brackets and an escaped quote inside a string are content
        ('{"a": "x\\', b""),  # in the middle of an escape: nothing closes it
        ('[[], {"k": []}', b"]"),
        ('{"a": 1}', b""),
    ],
)
def test_lexer_knows_what_closes_the_text(text, closing):
    lexer = JsonLexer()
    for i in range(0, len(text), 3):  # fed in pieces, as tokens come
        lexer.feed(text[i : i + 3].encode())
    assert lexer.closing_text() == closing
