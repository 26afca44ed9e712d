"""The Responses API request (POST /v1/responses, /serving-endpoints/responses): its fields and
ranges, the input items as the chat messages a template renders, and the translation
(docs/apis.md#responses-api). The response object and the stream events are in
`responses_render.py`.

Input items: a string (one user turn) or a list of messages (`role` user / assistant / system /
developer, `content` a string or `input_text` / `output_text` blocks), `function_call` items
(an earlier call of the model) and `function_call_output` items (its result); `instructions`
becomes the system message before them. Tools and tool_choice are accepted in the Responses
shape (`{"type": "function", "name", ...}`) and in the chat one (`{"type", "function": {...}}`).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field

from serve_app.messages import ErrorKind, ReplicaRequest, TokenizedPrompt, TokenizeRequest
from serve_app.protocol.databricks_common import PositiveInt, Temperature, TopLogprobs, TopP
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError, invalid
from serve_app.protocol.fields import RequestModel
from serve_app.protocol.openai_common import StreamOptions, StreamUsage
from serve_app.protocol.pd_refusals import refuse_in_pd
from serve_app.protocol.sampling import sampled_request
from serve_app.protocol.structured_output import output_constraint
from serve_app.protocol.tool_calls import (
    Tool,
    ToolChoice,
    check_tools,
    forced_tools,
    offered_names,
    offered_tools,
)
from serve_app.structured import JsonConstraint

# Refused when present, as Databricks documents: nothing is stored or run in the background.
UNSUPPORTED = {
    "background": "background processing is not supported",
    "store": "stored responses are not supported",
    "conversation": "the conversations API is not supported",
    "service_tier": "service tiers are not offered here",
    "previous_response_id": "stored responses are not supported: send the whole input",
    "prompt": "stored prompt templates are not supported: send the input itself",
    "reasoning": "only reasoning models take it; the models served here do not reason",
}
MAX_METADATA = 16
_SCHEMA_KEYS = ("name", "description", "schema", "strict")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _nested_tool(value: Any) -> Any:
    """{"type": "function", "name": ..., "parameters": ...} -> the chat shape."""
    if isinstance(value, dict) and "function" not in value and "name" in value:
        function = {k: v for k, v in value.items() if k != "type"}
        return {"type": value.get("type"), "function": function}
    return value


def _nested_choice(value: Any) -> Any:
    if isinstance(value, dict) and "function" not in value and "name" in value:
        return {"type": value.get("type"), "function": {"name": value["name"]}}
    return value


def _metadata(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise ValueError(f"must be an object of at most {MAX_METADATA} key-value pairs")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise ValueError("must map keys of at most 64 characters to strings of at most 512")
    return value


class TextFormat(RequestModel):
    """OpenAI's flat `{"type": "json_schema", "name", "schema", "strict"}`, or Databricks'
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    def response_format(self) -> dict[str, Any]:
        """As chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        flat = {k: v for k, v in (self.model_extra or {}).items() if k in _SCHEMA_KEYS}
        return {"type": "json_schema", "json_schema": self.json_schema or flat}


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ResponsesRequest(StreamUsage, RequestModel):
    model: str | None = Field(None, description="The endpoint (model) that answers.")
    input: str | list[dict[str, Any]] = Field(
        description="A string, or a list of messages, function_call and function_call_output."
    )
    instructions: str | None = Field(None, description="The system message, first.")
    max_output_tokens: PositiveInt = Field(None, description="null (model limit) or > 0.")
    temperature: Temperature = Field(None, description="[0.0, 2.0], default 1.0; 0 is greedy.")
    top_p: TopP = Field(None, description="(0.0, 1.0], default 1.0.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[Annotated[Tool, BeforeValidator(_nested_tool)]] | None = None
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_nested_choice)] = None
    parallel_tool_calls: bool | None = Field(True, description="false: at most one call.")
    max_tool_calls: PositiveInt = Field(None, description="Built-in tool calls: none here.")
    metadata: Annotated[dict[str, str] | None, BeforeValidator(_metadata)] = None
    top_logprobs: TopLogprobs = Field(None, description="[0, 20] alternatives per token.")
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: an input over the context keeps its end; disabled: 400."
    )
    # accepted, no effect here
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    user: str | None = None

    # refused when present (UNSUPPORTED)
    background: Any = None
    store: Any = None
    conversation: Any = None
    service_tier: Any = None
    previous_response_id: Any = None
    prompt: Any = None
    reasoning: Any = None

    def check(self, pd_mode: bool) -> None:
        for name, why in UNSUPPORTED.items():
            if getattr(self, name) is not None:
                raise APIError(ErrorKind.UNSUPPORTED, f"{name} is not supported: {why}", name)
        refuse_in_pd(pd_mode, {"top_logprobs": self.top_logprobs is not None})
        self.check_stream_options()
        check_tools(self.tools, self.tool_choice)
        _ = self.constraint  # an unusable schema is a 400 before any model work
        self.messages()  # the input items' own rules, before any model work

    @cached_property  # checked in check(), used in replica_request(): built once
    def constraint(self) -> JsonConstraint | None:
        forced = forced_tools(self.tools, self.tool_choice)
        fmt = self.text.format if self.text else None
        fmt = fmt.response_format() if fmt else None
        return output_constraint(fmt, forced, param="text.format")

    @property
    def tool_names(self) -> set[str] | None:
        return offered_names(self.tools, self.tool_choice)

    @property
    def want_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            if not self.input:
                raise invalid("input", "must be a non-empty string or a non-empty list of items")
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise invalid("input", "must be a non-empty string or a non-empty list of items")
        for i, item in enumerate(self.input):
            _append_item(out, item, f"input[{i}]")
        return out

    def tokenize_request(self, model: str) -> TokenizeRequest:
        tools = offered_tools(self.tools, self.tool_choice)
        return TokenizeRequest(
            model=model, kind="chat", messages=self.messages(), param="input", tools=tools,
            truncate=self.truncation == "auto",
        )  # fmt: skip

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        return sampled_request(
            request_id, prompt, defaults,
            temperature=self.temperature, top_p=self.top_p,
            max_tokens=self.max_output_tokens, stream=self.stream,
            logprobs=(self.top_logprobs or 0) if self.want_logprobs else None,
            constraint=self.constraint,
        )  # fmt: skip


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(where, "must be a string or a non-empty list of content blocks")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("input_text", "output_text") and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("input_image", "input_file"):
            raise APIError(
                ErrorKind.UNSUPPORTED,
                f"{where}[{j}]: {kind} blocks are not supported: the models served here read text",
                f"{where}[{j}].type",
            )
        else:
            raise invalid(f"{where}[{j}]", "must be {type: input_text | output_text, text: string}")
    return "\n".join(texts)


def _append_item(out: list[dict], item: Any, where: str) -> None:
    """One input item as chat messages: consecutive function calls share an assistant turn."""
    if not isinstance(item, dict):
        raise invalid(where, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            rule = f"must be user, assistant, system or developer, got {role!r}"
            raise invalid(f"{where}.role", rule)
        role = "system" if role == "developer" else role
        out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        for key in ("call_id", "name"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise invalid(f"{where}.{key}", "is required (a non-empty string)")
        arguments = item.get("arguments", {})
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": _object(arguments)}}  # fmt: skip
        last = out[-1] if out else None
        if last and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            raise invalid(f"{where}.call_id", "is required (a non-empty string)")
        output = item.get("output")
        if output is None:
            raise invalid(f"{where}.output", "is required (a string or a JSON object)")
        text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    else:
        raise invalid(
            f"{where}.type", f"must be message, function_call or function_call_output, got {kind!r}"
        )


def _object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # deep nesting is no JSON we read either
            return arguments
    return arguments
