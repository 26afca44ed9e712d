"""Tool calling for the chat APIs: the `tools` / `tool_choice` request fields with their limits,
and the model's reply parsed back into OpenAI `tool_calls` (docs/apis.md#tool-calls).

The model is asked (by its template, or by `tokenizer/tools.py`) to write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a reply that is nothing but such a
JSON object (what a constrained call produces, and what small models often write) counts too.
A call naming no offered function stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import RequestModel

MAX_TOOLS = 32
MAX_PROPERTIES = 15
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class FunctionDef(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="1 to 64 of a-z A-Z 0-9 _ -")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON Schema object with at most 15 properties; absent: none."
    )
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _at_most_15_properties(cls, value):
        if value is None:
            return value
        properties = value.get("properties") or {}
        if not isinstance(properties, dict):
            raise ValueError("must be a JSON Schema object: properties must be an object")
        if len(properties) > MAX_PROPERTIES:
            count = len(properties)
            raise ValueError(f"must have at most {MAX_PROPERTIES} properties, got {count}")
        return value


class Tool(RequestModel):
    type: Literal["function"] = Field(description="Only function tools are supported.")
    function: FunctionDef


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "required", "none"] | NamedToolChoice


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """The rules across `tools` and `tool_choice` (400 naming the parameter)."""
    names = [t.function.name for t in tools or []]
    if len(names) > MAX_TOOLS:
        raise invalid("tools", f"must have at most {MAX_TOOLS} functions, got {len(names)}")
    if len(set(names)) < len(names):
        raise invalid("tools", "must name each function once")
    if tools is not None and not tools:
        raise invalid("tools", "must have at least one function when set")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        offered = ", ".join(names) or "none"
        raise invalid(
            "tool_choice.function.name",
            f"must be one of the tools' names ({offered}), got {choice.function.name!r}",
        )
    if choice == "required" and not names:
        raise invalid("tool_choice", "cannot be required without tools")


def effective_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """tool_choice's default: auto with tools, none without."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"


def offered_names(tools: list[Tool] | None, choice: ToolChoice | None) -> set[str] | None:
    """The functions a reply is parsed for calls to; None when no tool is on offer."""
    if not tools or effective_choice(tools, choice) == "none":
        return None
    return {t.function.name for t in tools}


def offered_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools as the chat template gets them; None when none is on offer."""
    if offered_names(tools, choice) is None:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def forced_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools a call must be made to (a constrained reply), or None when the model chooses
    (or has no tools)."""
    if not tools:
        return None
    choice = effective_choice(tools, choice)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    elif choice != "required":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def _call(obj: Any, names: set[str]) -> dict | None:
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or name not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    else:
        text = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": text},
    }


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # deep nesting is no JSON we read either
        return None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: tagged calls anywhere, or the whole reply as one call
    (or a list of calls); the rest of the text is the content (None when nothing is left)."""
    calls, kept, end = [], [], 0
    for match in _TAGGED.finditer(text):
        call = _call(_json(match.group(1)), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[end : match.start()])
        end = match.end()
    if calls:
        kept.append(text[end:])
        content = "".join(kept).strip()
        return content or None, calls
    whole = _json(text.strip())
    for obj in whole if isinstance(whole, list) else [whole]:
        call = _call(obj, names)
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _message_with_calls(message: dict, names: set[str]) -> bool:
    content, calls = parse_tool_calls(message.get("content") or "", names)
    if calls:
        message["content"] = content
        message["tool_calls"] = calls
    return bool(calls)


def with_tool_calls(response: dict, names: set[str]) -> dict:
    """A chat response whose replies are parsed for calls: a reply with calls gets `tool_calls`
    and finish_reason "tool_calls"."""
    for choice in response["choices"]:
        if _message_with_calls(choice["message"], names):
            choice["finish_reason"] = "tool_calls"
    return response


class ToolCallStream:
    """Chat stream events with tools offered: a reply can only be told from a call once it is
    whole, so each choice's deltas are held back and sent as one delta (content and/or
    `tool_calls` with their `index`) just before its finish chunk. Other events pass."""

    def __init__(self, events, names: set[str]) -> None:
        self.inner = events  # ReplicaChunk -> list of chat chunk dicts (ChatStream.events)
        self.names = names
        self.held: dict[int, dict] = {}  # choice index -> the held chunk, deltas merged

    def events(self, chunk) -> list[dict]:
        out = []
        for event in self.inner(chunk):
            if not event["choices"]:
                out.append(event)
                continue
            choice = event["choices"][0]
            held = self.held.get(choice["index"])
            if choice["finish_reason"] is None:
                if held is None:
                    self.held[choice["index"]] = event
                else:
                    self._merge(held["choices"][0], choice)
                continue
            if held is not None:
                delta = held["choices"][0]["delta"]
                if _message_with_calls(delta, self.names):
                    delta["tool_calls"] = [
                        {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
                    ]
                    choice["finish_reason"] = "tool_calls"
                out.append(held)
            out.append(event)
        return out

    @staticmethod
    def _merge(into: dict, later: dict) -> None:
        into["delta"]["content"] = (into["delta"].get("content") or "") + (
            later["delta"].get("content") or ""
        )
        if later.get("logprobs"):
            into.setdefault("logprobs", {"content": []})["content"] += later["logprobs"]["content"]
