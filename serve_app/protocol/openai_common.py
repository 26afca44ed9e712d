"""What the two OpenAI-shaped routes (chat, completions) share: field types, the PD-mode
refusals, usage, and the in-stream error event (stop strings: `fields.Stop`, shared with Triton).

Union-typed fields (a completion `prompt`, a chat message's `content`) are validated by
one plain function each instead of a pydantic union: a union's errors name internal branches
("stop.str", "stop.list[str]"), while a client needs "stop must be ..., got ...".
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, Field, PlainValidator, WithJsonSchema

from serve_app.disagg.rules import refuse_unsupported
from serve_app.protocol.errors import APIError
from serve_app.protocol.fields import INT32_MAX, STRICT, UINT64_MAX, Range

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


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = Field(
        False, description="Chat: one more chunk before [DONE] with empty choices and usage."
    )


def text_parts(content: Any) -> str:
    """The text of a message content (a string, or text parts joined as the tokenizer pool
    joins them), for the 512 KB rule."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def refuse_in_pd(pd_mode: bool, given: dict[str, bool]) -> None:
    """inferMode dmi (PD separation) cannot run these (MINDIE.md): refuse before any work."""
    refuse_unsupported(pd_mode, given)


def invalid(param: str, message: str) -> APIError:
    return APIError("validation", f"{param} {message}", param)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
