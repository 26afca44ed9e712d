"""Range validators whose messages name the allowed range in interval notation.

`Range(0.0, 2.0, low_open=True)` inside `Annotated[float | None, ...]` refuses 0 with
"must be in (0.0, 2.0]"; the ingress's error renderer prefixes the parameter name and appends
the value ("temperature must be in (0.0, 2.0], got 0.0"). Request models use `STRICT` so that a
string is never silently taken for a number or a boolean.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    PlainValidator,
    WithJsonSchema,
    model_validator,
)

# Unknown fields are ignored (as vLLM and MindIE do); types are strict: "0.5" is not a float,
# "true" is not a bool, 1.5 and true are not ints. Ints are accepted for floats.
STRICT = ConfigDict(extra="ignore", strict=True)


class RequestModel(BaseModel):
    """The base of every request body and of every object inside one: `STRICT`, and an explicit
    null for an optional field reads as the field not given (its default), in every API family.
    Clients built from typed models (the openai and databricks SDKs, generated clients) send
    null for every field they leave unset; a required field stays required."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
# stop: a string of 1..32768 characters, or a list of non-empty strings of at most 32768 in all
# (docs/apis.md#common-rules). Chat, completions and Triton's generate share the rule.
MAX_STOP_CHARS = 32 * 1024


def describe_range(
    low: float | None,
    high: float | None,
    low_open: bool = False,
    high_open: bool = False,
    also: tuple = (),
) -> str:
    if low is not None and high is not None:
        text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        text = f"{'>' if low_open else '>='} {low}"
    elif high is not None:
        text = f"{'<' if high_open else '<='} {high}"
    else:
        text = "a finite number"
    if also:
        text = " or ".join(str(v) for v in also) + f" or {text}"
    return f"must be {text}"


def Range(  # noqa: N802 - reads as a type annotation
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    also: tuple = (),
) -> AfterValidator:
    """A validator for Annotated[...]: None passes (the field is optional), NaN never does."""
    message = describe_range(low, high, low_open, high_open, also)

    def check(value):
        if value is None or value in also:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(message)
        if low is not None and (value <= low if low_open else value < low):
            raise ValueError(message)
        if high is not None and (value >= high if high_open else value > high):
            raise ValueError(message)
        return value

    return AfterValidator(check)


def stop_strings(value: Any) -> list[str] | None:
    """The stop rules, checked as one parameter (a pydantic union's errors would name
    its branches, "stop.str" / "stop.list[str]"); the result is a list, None when empty."""
    if value is None:
        return None
    if isinstance(value, str):
        if not 1 <= len(value) <= MAX_STOP_CHARS:
            raise ValueError(
                f"must be a non-empty string (1 to {MAX_STOP_CHARS} characters) or a list of "
                "non-empty strings"
            )
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("must be a string or a list of strings")
    if not all(value):
        raise ValueError("must be a list of non-empty strings")
    if sum(len(s) for s in value) > MAX_STOP_CHARS:
        raise ValueError(f"must have at most {MAX_STOP_CHARS} characters in all its strings")
    return value or None


def word_list(value: Any) -> list[str] | None:
    """TensorRT-LLM's `stop_words` / `bad_words`: the stop rules, except that an empty string
    (what its clients send for "none") is dropped instead of refused."""
    words = [value] if isinstance(value, str) else value
    if isinstance(words, list):
        words = [w for w in words if w != ""]
    return stop_strings(words)


Words = Annotated[
    list[str] | None,
    PlainValidator(word_list),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
]


STOP_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
            {"type": "array", "items": {"type": "string", "minLength": 1}},
            {"type": "null"},
        ]
    }
)
Stop = Annotated[list[str] | None, PlainValidator(stop_strings), STOP_SCHEMA]


def StringOrStrings(  # noqa: N802 - reads as a type annotation
    max_items: int, rule: str, max_chars: int | None = None
) -> Any:
    """A field that takes one non-empty string or a list of 1 to `max_items` of them (each at
    most `max_chars`), always read as a list; anything else is refused with `rule`."""

    def check(value: Any) -> list[str]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not 1 <= len(items) <= max_items:
            raise ValueError(rule)
        for item in items:
            if not isinstance(item, str) or not item or (max_chars and len(item) > max_chars):
                raise ValueError(rule)
        return items

    one = {"type": "string", "minLength": 1}
    if max_chars:
        one["maxLength"] = max_chars
    many = {"type": "array", "items": {"type": "string", "minLength": 1},
            "minItems": 1, "maxItems": max_items}  # fmt: skip
    return Annotated[list[str], PlainValidator(check), WithJsonSchema({"anyOf": [one, many]})]
