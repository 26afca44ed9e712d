"""Schemas and checks the structured-output tests share (not tests)."""

import json

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MIXED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 2},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "nick": {"type": "string"}},
            "required": ["id"],
        },
        "note": {"type": "string"},  # optional
    },
    "required": ["title", "score", "ok", "color", "ids", "owner"],
}
NESTED = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "tags"],
            },
        }
    },
    "required": ["items"],
}
ANY_OBJECT = {"type": "object"}
SCHEMAS = {"person": PERSON, "mixed": MIXED, "nested": NESTED}


def assert_valid(text, schema):
    """The text is one JSON value (strict json.loads: no raw control characters) valid against
    the schema; returns the value."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def assert_idle(llm):
    """Every KV block back in the pool and no request left."""
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert not llm.engine.requests
