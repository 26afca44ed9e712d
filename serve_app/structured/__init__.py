"""Structured output: constrained decoding that makes a model's output valid JSON, one object
(`json_object`) or a value valid against a JSON schema (`json_schema`), within max_tokens.

The protocol layer builds a `JsonConstraint` (`from_response_format`, `json_schema`,
`json_object`, `tool_call_schema`) and sets it as `SamplingParams.constraint`; the engine
starts one grammar state per sequence from it through its constraint hook
(`serve_app/engine/constraint.py`). xgrammar does the grammar work; it is imported only when a
schema is checked or a state starts.
"""

from serve_app.structured.spec import (
    JsonConstraint,
    ResponseFormatError,
    from_response_format,
    json_object,
    json_schema,
    min_output_tokens,
)
from serve_app.structured.tools import tool_call_schema

__all__ = [
    "JsonConstraint",
    "ResponseFormatError",
    "from_response_format",
    "json_object",
    "json_schema",
    "min_output_tokens",
    "tool_call_schema",
]
