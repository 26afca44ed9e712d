"""What the two OpenAI-shaped routes (chat, completions) share: field types and usage (stop
strings: `fields.Stop`, shared with Triton; PD refusals: `pd_refusals`).

Union-typed fields (a completion `prompt`, a chat message's `content`) are validated by
one plain function each instead of a pydantic union: a union's errors name internal branches
("stop.str", "stop.list[str]"), while a client needs "stop must be ..., got ...".
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, PlainValidator, WithJsonSchema

from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import INT32_MAX, UINT64_MAX, Range, RequestModel

_MODEL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
MODEL_NAME_RULE = (
    "must be 1 to 256 letters, digits, '.', '-' or '_', not starting or ending with '.', '-' or '_'"
)


def _model_name(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256 or not _MODEL_NAME.fullmatch(value):
        raise ValueError(MODEL_NAME_RULE)
    return value


ModelName = Annotated[
    str,
    PlainValidator(_model_name),
    WithJsonSchema({"type": "string", "maxLength": 256, "pattern": f"^{_MODEL_NAME.pattern}$"}),
]
Penalty = Annotated[float | None, Range(-2.0, 2.0)]
RepetitionPenalty = Annotated[float | None, Range(0.0, 2.0, low_open=True)]
Seed = Annotated[int | None, Range(0, UINT64_MAX, low_open=True)]
MaxTokens = Annotated[int | None, Range(0, INT32_MAX, low_open=True)]
TopK = Annotated[int | None, Range(0, INT32_MAX, low_open=True, also=(-1,))]
Priority = Annotated[int | None, Range(1, 5)]
NumSeqs = Annotated[int | None, Range(1, 128)]
StreamInterval = Annotated[int | None, Range(1, INT32_MAX)]


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(
        False, description="Chat: one more chunk before [DONE] with empty choices and usage."
    )


class StreamUsage:
    """What a request with `stream` and `stream_options` (a pydantic model) reads from them, the
    same way in every OpenAI-shaped family."""

    stream: bool | None
    stream_options: StreamOptions | None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "can only be set when stream is true")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
