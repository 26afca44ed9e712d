"""Tool calls as a JSON schema, so that a forced tool call (OpenAI `tool_choice`: "required" or
a named function) is one more `json_schema` constraint: the model writes
`{"name": <one of the tools>, "arguments": {...valid against that tool's parameters...}}`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_ANY_OBJECT = {"type": "object"}


def tool_call_schema(
    tools: Sequence[Mapping[str, Any]], *, parallel: bool = False
) -> dict[str, Any]:
    """The schema of one call to any of `tools` (OpenAI's `tools` entries, `{"type": "function",
    "function": {"name", "parameters"}}`, or the bare function objects); with `parallel`, a
    non-empty array of such calls. Pass one tool to force that one."""
    calls = []
    for tool in tools:
        function = tool.get("function", tool)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("every tool needs a function name")
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": function.get("parameters") or _ANY_OBJECT,
                },
                "required": ["name", "arguments"],
            }
        )
    if not calls:
        raise ValueError("no tools to call")
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": call, "minItems": 1} if parallel else call
