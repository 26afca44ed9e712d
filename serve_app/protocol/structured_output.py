"""The output constraint of a chat-like request: a JSON `response_format` (chat) or `text.format`
(Responses), or a forced tool call (`tool_choice` required or a named function), as the
`JsonConstraint` the engine decodes under (serve_app/structured/; docs/apis.md#json-output).

Checked before any model work: a schema xgrammar cannot use is a 400 naming the field. A forced
call is a JSON schema of `{"name": <an offered function>, "arguments": <its parameters>}`, which
the tool-call parser reads back. Stop strings could cut the JSON, so they are refused with it.
"""

from __future__ import annotations

from typing import Any

from serve_app.protocol.errors import invalid
from serve_app.structured import (
    JsonConstraint,
    ResponseFormatError,
    from_response_format,
    json_schema,
    tool_call_schema,
)


def output_constraint(
    response_format: dict[str, Any] | None,
    forced_tools: list[dict] | None,
    *,
    param: str = "response_format",
    has_stop: bool = False,
) -> JsonConstraint | None:
    """The request's constraint, None when it asks for free text. APIError (400) when the
    format is unusable, or combined with what would break it."""
    wants_json = response_format is not None and response_format.get("type") != "text"
    if forced_tools and wants_json:
        raise invalid(param, "cannot ask for JSON output while tool_choice forces a tool call")
    if (forced_tools or wants_json) and has_stop:
        raise invalid("stop", "cannot be used with JSON output or a forced tool call (it could "
                      "cut the JSON)")  # fmt: skip
    if forced_tools:
        try:
            return json_schema(tool_call_schema(forced_tools))
        except ValueError as exc:
            raise invalid("tools", f"cannot be forced: {exc}") from None
    try:
        return from_response_format(response_format, param)
    except ResponseFormatError as exc:
        raise invalid(exc.param, exc.message) from None
