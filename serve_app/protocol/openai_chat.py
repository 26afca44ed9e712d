"""POST /v1/chat/completions, MindIE flavour, with the common OpenAI/vLLM extras.

Request model with every range (docs/apis.md#openai-chat-completions), its translation to a
`TokenizeRequest` (the chat template runs in the tokenizer pool, so the templated prompt obeys
the chat token rule and usage counts the template's tokens) and to a `ReplicaRequest`, and the
renderers of the response and of the stream chunks. Finish reasons are MindIE's words
(eos_token / length / stop_sequence), as its documented answers show, not OpenAI's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, PlainValidator, WithJsonSchema

from serve_app.messages import (
    ChoiceDelta,
    ReplicaChunk,
    ReplicaRequest,
    TokenizedPrompt,
    TokenizeRequest,
    TokenLogprobText,
    text_of,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import Range, RequestModel, Stop, describe_range
from serve_app.protocol.openai_common import (
    MaxTokens,
    ModelName,
    NumSeqs,
    Penalty,
    Priority,
    RepetitionPenalty,
    Seed,
    StreamInterval,
    StreamOptions,
    StreamUsage,
    TopK,
    usage,
)
from serve_app.protocol.pd_refusals import refuse_in_pd
from serve_app.protocol.sampling import mindie_finish, sampling_params

MAX_MESSAGE_CHARS = 512 * 1024  # all message contents together: 1 to 524288 characters
_CONTENT_RULE = "must be a non-empty string or a non-empty list of text parts"


def _content(value: Any) -> str | list[dict]:
    if isinstance(value, str):
        if not value:
            raise ValueError(_CONTENT_RULE)
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(_CONTENT_RULE)
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{_CONTENT_RULE}; only text parts are supported, got a {kind!r} part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{_CONTENT_RULE}: each part is {{'type': 'text', 'text': string}}")
    if not text_of(value):
        raise ValueError(_CONTENT_RULE)
    return [{"type": "text", "text": part["text"]} for part in value]


Content = Annotated[
    str | list[dict],
    PlainValidator(_content),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "object"}, "minItems": 1},
            ]
        }
    ),
]


class ChatMessage(RequestModel):
    # Other keys (name, tool_call_id, tool_calls) go through to the model's chat template.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Content


def non_empty_messages(value: list) -> list:
    if not value:
        raise ValueError("must be a non-empty list of messages")
    return value


class ChatCompletionRequest(StreamUsage, RequestModel):
    model: ModelName = Field(
        description="A served model name: 1 to 256 letters, digits, '.', '-', '_'; "
        "not starting or ending with '.', '-', '_'."
    )
    messages: Annotated[list[ChatMessage], AfterValidator(non_empty_messages)] = Field(
        description="Roles system/user/assistant/tool; all contents together in (0, 512 KB]."
    )
    max_tokens: MaxTokens = Field(
        None, description="(0, maxIterTimes], default maxIterTimes; larger is refused."
    )
    max_completion_tokens: MaxTokens = Field(
        None, description="OpenAI's newer max_tokens, the same range."
    )
    presence_penalty: Penalty = Field(None, description="[-2.0, 2.0], default 0.0.")
    frequency_penalty: Penalty = Field(None, description="[-2.0, 2.0], default 0.0.")
    seed: Seed = Field(None, description="(0, 18446744073709551615]; absent: random.")
    temperature: Annotated[float | None, Range(0.0, 2.0, low_open=True)] = Field(
        None, description="(0.0, 2.0], default 1.0."
    )
    top_p: Annotated[float | None, Range(0.0, 1.0, low_open=True)] = Field(
        None, description="(0.0, 1.0], default 1.0."
    )
    stream: bool | None = Field(False, description="Server-sent events, ending in [DONE].")
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="A string or a list of strings that end the reply.")
    stop_token_ids: list[int] | None = Field(None, description="Ids outside int32 are ignored.")
    include_stop_str_in_output: bool | None = False
    top_k: TopK = Field(None, description="-1 (off) or (0, 2147483647].")
    repetition_penalty: RepetitionPenalty = Field(None, description="(0.0, 2.0], default 1.0.")
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    n: NumSeqs = Field(None, description="[1, 128] replies, default 1.")
    logprobs: bool | None = Field(False, description="Log-probability of each reply token.")
    top_logprobs: Annotated[int | None, Range(0, 20)] = Field(
        None, description="[0, 20] alternatives per token; needs logprobs=true."
    )
    priority: Priority = Field(None, description="[1, 5], 1 first; default 5.")
    stream_interval: StreamInterval = Field(
        None,
        description="[1, 2147483647] tokens per streamed chunk (vLLM's), the first and last "
        "chunks at once; raises the server's streamInterval, never lowers it.",
    )

    def check(self, pd_mode: bool) -> None:
        """PD refusals first (what PD cannot run is named as such), then the rules across
        fields (raised as 400 naming the parameter)."""
        refuse_in_pd(
            pd_mode,
            {
                "stop": bool(self.stop),
                "include_stop_str_in_output": bool(self.include_stop_str_in_output),
                "n": (self.n or 1) > 1,
                "logprobs": bool(self.logprobs),
                "top_logprobs": self.top_logprobs is not None,
            },
        )
        chars = sum(len(text_of(m.content)) for m in self.messages)
        if chars > MAX_MESSAGE_CHARS:
            raise invalid(
                "messages",
                f"must have in (0, {MAX_MESSAGE_CHARS}] characters of content (512 KB), "
                f"got {chars}",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "can only be set when logprobs is true")
        self.check_stream_options()

    def tokenize_request(self, model: str) -> TokenizeRequest:
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        return TokenizeRequest(model=model, kind="chat", messages=messages, param="messages")

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        param = "max_tokens" if self.max_tokens is not None else "max_completion_tokens"
        max_tokens = getattr(self, param)
        limit = defaults.limits.max_iter_times
        if max_tokens is not None and max_tokens > limit:  # chat's range is (0, maxIterTimes]
            range_ = describe_range(0, limit, low_open=True)
            raise invalid(param, f"{range_} (maxIterTimes), got {max_tokens}")
        params = sampling_params(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=defaults.limits.max_output_tokens(max_tokens),
            n=self.n,
            ignore_eos=bool(self.ignore_eos),
            stop_token_ids=self.stop_token_ids,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )
        return ReplicaRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            params=params,
            priority=defaults.priority_of(self.priority),
            stop=self.stop or [],
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            stream_interval=self.stream_interval or 1,
            stream=bool(self.stream),
            logprob_texts=bool(self.logprobs),
        )


# -- responses --------------------------------------------------------------------------------


def _logprob_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(logprobs: list[TokenLogprobText] | None) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for lp in logprobs or []:
        entry = _logprob_entry(lp.token, lp.logprob)
        entry["top_logprobs"] = [_logprob_entry(text, value) for _, text, value in lp.top]
        content.append(entry)
    return {"content": content}


def chat_response(
    request_id: str, created: int, model: str, chunk: ReplicaChunk, prompt_tokens: int,
    want_logprobs: bool, finish: Callable[[str | None], str | None] = mindie_finish,
) -> dict:  # fmt: skip
    """The non-stream body (logprobs added only when asked); `finish` words the finish reason
    (MindIE's here, OpenAI's for the Databricks family)."""
    choices = []
    for c in chunk.choices:
        choice: dict = {"index": c.index, "message": {"role": "assistant", "content": c.text}}
        if want_logprobs:
            choice["logprobs"] = chat_logprobs(c.logprobs)
        choice["finish_reason"] = finish(c.finish_reason)
        choices.append(choice)
    completion_tokens = sum(c.num_output_tokens for c in chunk.choices)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


class ChatStream:
    """Replica chunks -> stream chunks: the role in every delta, an empty delta with
    the finish reason per choice, then (include_usage) a usage chunk with empty choices."""

    def __init__(
        self, request_id: str, created: int, model: str, prompt_tokens: int,
        want_logprobs: bool, include_usage: bool,
        finish: Callable[[str | None], str | None] = mindie_finish,
    ) -> None:  # fmt: skip
        self.finish = finish
        self.head = {"id": request_id, "object": "chat.completion.chunk", "created": created}
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.num_tokens: dict[int, int] = {}

    def _chunk(self, delta: ChoiceDelta, body: dict, finish: str | None) -> dict:
        choice: dict = {"index": delta.index, "delta": body}
        if self.want_logprobs and body:
            choice["logprobs"] = chat_logprobs(delta.logprobs)
        choice["finish_reason"] = finish
        out = {**self.head, "model": self.model, "choices": [choice]}
        if self.include_usage:  # OpenAI: with include_usage, every other chunk has usage null
            out["usage"] = None
        return out

    def events(self, chunk: ReplicaChunk) -> list[dict]:
        out = []
        for delta in chunk.choices:
            self.num_tokens[delta.index] = delta.num_output_tokens
            if delta.text or (self.want_logprobs and delta.logprobs):
                out.append(self._chunk(delta, {"role": "assistant", "content": delta.text}, None))
            if delta.finish_reason is not None:
                out.append(self._chunk(delta, {}, self.finish(delta.finish_reason)))
        if chunk.finished and self.include_usage:
            tokens = sum(self.num_tokens.values())
            out.append(
                {**self.head, "model": self.model, "choices": [],
                 "usage": usage(self.prompt_tokens, tokens)}
            )  # fmt: skip
        return out
