"""Databricks chat (task llm/v1/chat): the request with its ranges and message rules, and its
translation; the response and stream renderers are the OpenAI ones with OpenAI's finish words
(docs/apis.md#databricks-chat).

Message rules (400 naming `messages[i]...`): `system` at most once, first; `tool` messages need
`tool_call_id`, other roles may not carry one; `tool_calls` only on `assistant`, which then needs
no content; every other message needs content.
"""

from __future__ import annotations

import contextlib
import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field

from serve_app.messages import ReplicaRequest, TokenizedPrompt, TokenizeRequest, text_of
from serve_app.protocol.databricks_common import DatabricksSampling, TopLogprobs
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import RequestModel, Stop
from serve_app.protocol.openai_chat import MAX_MESSAGE_CHARS, Content, non_empty_messages
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


class FunctionCall(RequestModel):
    name: str = Field(min_length=1, description="The function the model called.")
    arguments: str | dict = Field(description="Its arguments: a JSON object or its text.")


class ToolCall(RequestModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict:
        """As chat templates render a call: arguments as an object (sent as JSON text, they are
        parsed; text that is no JSON object stays text)."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError, RecursionError):
                parsed = json.loads(arguments)
                arguments = parsed if isinstance(parsed, dict) else arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}  # fmt: skip


class JsonSchemaFormat(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_message(self) -> dict:
        """The message as a chat template reads it (HF's tool-call shape: arguments a dict)."""
        out: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class DatabricksChatRequest(DatabricksSampling):
    messages: Annotated[list[ChatMessage], AfterValidator(non_empty_messages)] = Field(
        description="system (once, first), user, assistant (content or tool_calls), tool."
    )
    stop: Stop = Field(None, description="A string or a list of strings that end the reply.")
    logprobs: bool | None = Field(False, description="Log-probability of each reply token.")
    top_logprobs: TopLogprobs = Field(
        None, description="[0, 20] alternatives per token; needs logprobs=true."
    )
    tools: list[Tool] | None = Field(
        None, description="1 to 32 functions the model may call (at most 15 properties each)."
    )
    tool_choice: ToolChoice | None = Field(
        None, description="auto (default with tools) | required | none | {type, function: {name}}"
    )
    response_format: ResponseFormat | None = Field(
        None, description="text | json_object | json_schema {name, schema, strict}"
    )

    def check(self, pd_mode: bool) -> None:
        refuse_in_pd(
            pd_mode,
            {
                "stop": bool(self.stop),
                "n": (self.n or 1) > 1,
                "logprobs": bool(self.logprobs),
                "top_logprobs": self.top_logprobs is not None,
            },
        )
        self.check_common()
        _check_messages(self.messages)
        check_tools(self.tools, self.tool_choice)
        _ = self.constraint  # an unusable schema is a 400 before any model work
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "can only be set when logprobs is true")

    @property
    def tool_names(self) -> set[str] | None:
        return offered_names(self.tools, self.tool_choice)

    @cached_property  # checked in check(), used in replica_request(): built once
    def constraint(self) -> JsonConstraint | None:
        """What the reply is decoded under: a forced tool call, a JSON format, or nothing."""
        forced = forced_tools(self.tools, self.tool_choice)
        fmt = self.response_format
        return output_constraint(
            fmt.model_dump(by_alias=True, exclude_none=True) if fmt else None,
            forced,
            has_stop=bool(self.stop),
        )

    def tokenize_request(self, model: str) -> TokenizeRequest:
        messages = [m.template_message() for m in self.messages]
        tools = offered_tools(self.tools, self.tool_choice)
        return TokenizeRequest(
            model=model, kind="chat", messages=messages, param="messages", tools=tools
        )

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        return sampled_request(
            request_id, prompt, defaults,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, n=self.n, stream=self.stream, stop=self.stop,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            constraint=self.constraint,
        )  # fmt: skip


def _check_messages(messages: list[ChatMessage]) -> None:
    chars = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "system" and i > 0:
            raise invalid(f"{where}.role", "system can only be the first message")
        if m.role == "tool" and not m.tool_call_id:
            raise invalid(f"{where}.tool_call_id", "is required when role is tool")
        if m.role != "tool" and m.tool_call_id is not None:
            raise invalid(f"{where}.tool_call_id", f"must be empty when role is {m.role}")
        if m.tool_calls is not None and m.role != "assistant":
            raise invalid(f"{where}.tool_calls", "can only be set when role is assistant")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise invalid(f"{where}.content", f"is required for a {m.role} message")
        chars += len(text_of(m.content)) if m.content is not None else 0
    if chars > MAX_MESSAGE_CHARS:
        raise invalid(
            "messages",
            f"must have in (0, {MAX_MESSAGE_CHARS}] characters of content (512 KB), got {chars}",
        )
