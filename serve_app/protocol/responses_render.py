"""The Responses API's answer: the response object, and the typed events of its stream
(docs/apis.md#responses-api).

A reply becomes one `message` output item with one `output_text` part, or, with tools on offer,
`function_call` items (and a message for any text beside them). A reply cut by
max_output_tokens makes the response `incomplete` with reason `max_output_tokens`.

Stream: response.created, response.in_progress, then per output item output_item.added,
(content_part.added, output_text.delta..., output_text.done, content_part.done) or
(function_call_arguments.delta, function_call_arguments.done), output_item.done, and last
response.completed (or response.incomplete). Every event has `type` and a `sequence_number`
and is sent as `event: <type>` + `data: <json>`. Text streams as it comes; with tools on offer
the reply is held until it is whole (a call cannot be told from text before).
"""

from __future__ import annotations

import time
import uuid

from serve_app.messages import ChoiceDelta, ReplicaChunk, TokenLogprobText
from serve_app.protocol.event_json import compact_json
from serve_app.protocol.responses import ResponsesRequest
from serve_app.protocol.tool_calls import parse_tool_calls


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprobs(logprobs: list[TokenLogprobText] | None) -> list[dict]:
    return [
        {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode("utf-8")),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                          for _, t, v in lp.top]}
        for lp in logprobs or []
    ]  # fmt: skip


def usage(prompt_tokens: int, output_tokens: int) -> dict:
    """OpenAI's Responses usage, with the chat names beside them (the Databricks usage object
    is the same for every task)."""
    total = prompt_tokens + output_tokens
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": total,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": output_tokens,
    }


class ResponseBuilder:
    """One response: its fixed fields from the request, its output from the replica's chunks."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int) -> None:
        self.body = body
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.message_id = _id("msg")

    def envelope(self, status: str, output: list, tokens: int | None, finish: str | None) -> dict:
        b = self.body
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": None if tokens is None else usage(self.prompt_tokens, tokens),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "tools": [_flat_tool(t.model_dump(exclude_none=True)) for t in b.tools or []],
            "tool_choice": _flat_choice(b.tool_choice, bool(b.tools)),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "store": False,
            "metadata": b.metadata or {},
            "text": {"format": _format(b)},
            "top_logprobs": b.top_logprobs,
            "truncation": b.truncation or "disabled",
        }

    def items(self, text: str, logprobs: list | None, status: str) -> list[dict]:
        """The output items of a whole reply."""
        content, calls = text, []
        names = self.body.tool_names
        if names is not None:
            content, calls = parse_tool_calls(text, names)
            if self.body.parallel_tool_calls is False:
                calls = calls[:1]
        items = []
        if content is not None and (content or not calls):
            part = {"type": "output_text", "text": content, "annotations": []}
            if self.body.want_logprobs:
                part["logprobs"] = _logprobs(logprobs)
            items.append({"type": "message", "id": self.message_id, "status": status,
                          "role": "assistant", "content": [part]})  # fmt: skip
        for call in calls:
            function = call["function"]
            items.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                          "name": function["name"], "arguments": function["arguments"],
                          "status": "completed"})  # fmt: skip
        return items

    def response(self, chunk: ReplicaChunk) -> dict:
        """The non-stream body from the folded chunk."""
        choice = chunk.choices[0] if chunk.choices else ChoiceDelta(0, [], "")
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = self.items(choice.text, choice.logprobs, status)
        return self.envelope(status, output, choice.num_output_tokens, choice.finish_reason)


class ResponseStream:
    """Replica chunks -> typed Responses events (dicts with `type` and `sequence_number`)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        self.hold = builder.body.tool_names is not None
        self.text = ""
        self.logprobs: list[TokenLogprobText] = []
        self.open = False  # the message item and its text part have been announced

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        shell = self.b.envelope("in_progress", [], None, None)
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell)]  # fmt: skip

    def _open_message(self) -> list[dict]:
        self.open = True
        item = {"type": "message", "id": self.b.message_id, "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self.b.message_id, "output_index": 0, "content_index": 0}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", part=part, **where)]  # fmt: skip

    def events(self, chunk: ReplicaChunk) -> list[dict]:
        out = self.start() if self.seq == 0 else []
        for delta in chunk.choices:
            self.text += delta.text
            self.logprobs += delta.logprobs or []
            if not self.hold and (delta.text or delta.logprobs):
                if not self.open:
                    out += self._open_message()
                out.append(self._event(
                    "response.output_text.delta", item_id=self.b.message_id, output_index=0,
                    content_index=0, delta=delta.text, logprobs=_logprobs(delta.logprobs),
                ))  # fmt: skip
            if delta.finish_reason is not None:
                out += self._finish(delta)
        return out

    def _finish(self, delta: ChoiceDelta) -> list[dict]:
        status = "incomplete" if delta.finish_reason == "length" else "completed"
        items = self.b.items(self.text, self.logprobs, status)
        out = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                out += self._message_done(item, index)
            else:
                out += self._call_events(item, index)
        final = self.b.envelope(status, items, delta.num_output_tokens, delta.finish_reason)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._event(kind, response=final)]

    def error(self, error) -> dict:
        """A failure after the 200: the stream's last event."""
        status, kind = error.status("openai"), error.body("openai")["error"]["type"]
        return self._event("error", code=str(status), message=error.message,
                           param=error.param, error_type=kind)  # fmt: skip

    def _message_done(self, item: dict, index: int) -> list[dict]:
        out = [] if self.open else self._open_message()
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if self.hold and part["text"]:  # held back until whole: its text as one delta
            out.append(self._event("response.output_text.delta", delta=part["text"],
                                   logprobs=part.get("logprobs", []), **where))  # fmt: skip
        out.append(self._event("response.output_text.done", text=part["text"],
                               logprobs=part.get("logprobs", []), **where))  # fmt: skip
        out.append(self._event("response.content_part.done", part=part, **where))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _call_events(self, item: dict, index: int) -> list[dict]:
        where = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", delta=item["arguments"],
                        **where),
            self._event("response.function_call_arguments.done", arguments=item["arguments"],
                        name=item["name"], **where),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip


def _format(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text else None
    return fmt.model_dump(exclude_none=True) if fmt else {"type": "text"}


def _flat_tool(tool: dict) -> dict:
    """A tool as the Responses API shows it: {"type": "function", "name", ...}."""
    return {"type": "function", **tool.get("function", {})}


def _flat_choice(choice, has_tools: bool):
    if choice is None:
        return "auto" if has_tools else "none"
    if isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.function.name}


def sse_event(payload: dict) -> bytes:
    """A Responses stream event: its type on an `event:` line, then the data."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + compact_json(payload) + b"\n\n"
