"""Tools in the prompt: through the model's chat template when it renders them, else in our own
words, so that a model whose template knows nothing of tools (SmolLM2's, the demo's) is still
told which functions it may call and how (docs/apis.md#tool-calls).

The call format the model is asked for, and that `protocol/tool_calls.py` parses back, is the
one Qwen2.5 and Hermes templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def template_renders_tools(tokenizer) -> bool:
    """Whether the model's chat template reads a `tools` variable (HF templates that support
    tools all do)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool_use one counts
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def call_text(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _call_text(call) -> str | None:
    """An OpenAI tool call ({"function": {"name", "arguments"}}) as text, None if it is not one."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return call_text(function["name"], function.get("arguments", {}))


def _instructions(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more of these functions to answer (each with a JSON Schema of its "
        f"arguments):\n{listed}\n"
        "To call one, reply with nothing but this, once per call:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
        f"{CALL_CLOSE}"
    )


def with_tools(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list, dict]:
    """(messages, extra apply_chat_template arguments) for a conversation offering `tools`.

    A template that renders tools gets them as they are. Otherwise the tools and the call format
    go into the system message (a new one first when there is none), and earlier calls and
    their results become text the template can render: an assistant's `tool_calls` its
    content, a `tool` message's content as it is.
    """
    if template_renders_tools(tokenizer):
        return messages, ({"tools": tools} if tools else {})
    out = []
    for message in messages:
        calls = [_call_text(c) for c in message.get("tool_calls") or []]
        if calls and all(calls):  # else (a shape we do not know) the template sees it as sent
            texts = [message["content"]] if isinstance(message.get("content"), str) else []
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join([t for t in texts if t] + calls)
        out.append(message)
    if tools:
        text = _instructions(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}
