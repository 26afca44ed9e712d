"""The small dataclasses that cross deployment handles, defined once.

Request path: the ingress sends a `TokenizeRequest` to the tokenizer pool and gets back a
`TokenizedPrompt` (or a `Rejection`); it then sends a `ReplicaRequest` to a model replica and
iterates the `ReplicaChunk`s it yields. Nothing here imports fastapi, pydantic or ray: only token
ids, sampling parameters, text and numbers cross a handle, never a Starlette request or a pydantic
HTTP model. Errors travel as values (`Rejection`, `ReplicaChunk.error`), not as exceptions, so
each API family renders them in its own envelope.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from serve_app.engine.outputs import pickled_as_arguments
from serve_app.engine.params import DEFAULT_PRIORITY, FinishReason, SamplingParams


class ErrorKind(str, enum.Enum):
    """Why a request failed: the one vocabulary from where a failure is known (tokenizer pool,
    replica, pipeline, route) to the API family's renderer (`protocol/errors.py`), which turns
    a kind into that family's status code and body."""

    VALIDATION = "validation"  # a parameter outside its range, a prompt over its token limit
    UNSUPPORTED = "unsupported"  # valid, but not served here (PD mode, non-text content)
    NOT_FOUND = "not_found"  # unknown model, version, route or request id
    REJECTED = "rejected"  # well-formed, but the engine can never run it (KV pool too small)
    ENGINE = "engine"  # the engine or a replica failed while running it
    TIMEOUT = "timeout"  # the request's timeout, tokenTimeout or e2eTimeout
    UNAVAILABLE = "unavailable"  # the server is not ready
    TOO_LARGE = "too_large"  # the body is over maxRequestLength
    UNAUTHORIZED = "unauthorized"  # API keys are on and the request has none that matches
    OVERLOADED = "overloaded"  # maxLinkNum requests run and the admission queue is full


def text_of(content: Any) -> str:
    """A chat message's content as the model sees it: a string, or text parts joined with
    newlines (as vLLM joins them; many chat templates render only string content)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


# -- tokenizer pool ---------------------------------------------------------------------------


@dataclass(slots=True)
class TokenizeRequest:
    """What to turn into prompt token ids, and which token-count rule applies.

    kind: "completion" (text prompt), "chat" (messages through the chat template: the chat
    rule), "token_ids" (ids given by the client: vocabulary + length), "text" (/infer and
    Triton text_input: the completion rule), "templated" (a completion prompt as one user turn
    through the chat template when the model has one, else as is: the completion rule). See
    docs/apis.md#token-count-rules. truncate: a prompt over its limit keeps its last tokens
    instead of being refused, whatever the server's `truncation` says.
    """

    model: str
    kind: Literal["completion", "chat", "token_ids", "text", "templated"]
    text: str | None = None
    messages: list[dict] | None = None  # [{"role", "content"}], content str or text parts
    tools: list[dict] | None = None  # chat: OpenAI tool objects the model is offered
    token_ids: list[int] | None = None
    param: str = "prompt"  # the request field to name in a rejection
    add_special_tokens: bool = True
    truncate: bool = False
    add_generation_prompt: bool = True  # chat: end with the assistant turn's opening
    counting: bool = False  # /tokenize: no length rule, and each token's string returned


@dataclass(slots=True)
class TokenizedPrompt:
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    truncated: bool = False  # truncation=true cut the prompt to its limit
    prompt_text: str | None = None  # the templated chat prompt (for echo / debugging)
    token_strs: list[str] | None = None  # (counting) each id as the tokenizer spells it


@dataclass(slots=True)
class Rejection:
    """A request refused before any model work: the parameter (None when none is at fault),
    why, and its allowed range."""

    param: str | None
    message: str
    kind: ErrorKind = ErrorKind.VALIDATION


# -- model replica ----------------------------------------------------------------------------


@dataclass(slots=True)
class StreamAddress:
    """Where a replica may write a request's chunks instead of yielding them through Ray: the
    ingress's token socket (`token_socket/inbox.py`). `secret` opens it."""

    node_id: str | None  # the Ray node of the ingress: replicas there use the Unix socket
    path: str  # the Unix socket
    secret: bytes = field(repr=False)
    host: str | None = None  # with tokenStream "tcp": where replicas on other nodes connect
    port: int | None = None


@dataclass(slots=True)
class ReplicaRequest:
    request_id: str  # unique per ingress request; the engine's request id
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = DEFAULT_PRIORITY  # 1 highest .. 5 lowest
    timeout_s: float | None = None  # the request's own timeout; the replica sets the deadline
    stop: list[str] = field(default_factory=list)  # stop strings, matched exactly on the text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = True  # False: the replica yields one final chunk with everything
    token_texts: bool = False  # fill ChoiceDelta.token_texts (per-token text for token events)
    logprob_texts: bool = False  # fill TokenLogprobText.token/top as decoded strings
    reply_to: StreamAddress | None = None  # the ingress's token socket, when it has one
    stream_interval: int = 1  # stream: new tokens per chunk (but the first and the last)


@dataclass(slots=True)
class TokenLogprobText:
    """One output token's logprob, with decoded text for the API (completions `top_logprobs`)."""

    token_id: int
    logprob: float
    token: str = ""  # the token alone, decoded
    top: list[tuple[int, str, float]] = field(
        default_factory=list
    )  # (id, text, logprob), best first


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice (sequence) adds in a chunk; in a final non-stream chunk, all of it."""

    index: int
    token_ids: list[int]  # new output token ids
    text: str  # new text, stop strings applied (nothing past a stop string is ever sent)
    token_texts: list[str] | None = None  # per new token: its text delta ("" while incomplete)
    logprobs: list[TokenLogprobText] | None = None  # per new token, when asked for
    finish_reason: str | None = None  # an engine FinishReason value: eos, stop_token, ...
    stop_reason: str | None = None  # the stop string, or the stop token's text, that ended it
    num_output_tokens: int = 0  # output tokens of this choice so far (usage counts these)
    cumulative_logprob: float | None = None

    def absorb(self, later: ChoiceDelta) -> None:
        """Appends a later delta of the same choice: how a stream folds into one response."""
        self.token_ids = self.token_ids + later.token_ids
        self.text += later.text
        if later.token_texts is not None:
            self.token_texts = (self.token_texts or []) + later.token_texts
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        if later.stop_reason is not None:
            self.stop_reason = later.stop_reason
        self.num_output_tokens = max(self.num_output_tokens, later.num_output_tokens)
        if later.cumulative_logprob is not None:
            self.cumulative_logprob = later.cumulative_logprob


@dataclass(slots=True)
class StepInfo:
    """Timing of one engine step that produced tokens for this request (MindIE's facts)."""

    batch_size: int
    queue_wait_us: float
    prefill_time_ms: float | None = None  # first token: arrival to first token
    decode_time_ms: float | None = None  # later tokens: since the previous token


@dataclass(slots=True)
class ReplicaChunk:
    request_id: str
    choices: list[ChoiceDelta] = field(default_factory=list)
    steps: list[StepInfo] = field(default_factory=list)  # the steps folded into this chunk
    finished: bool = False
    num_prompt_tokens: int = 0
    error: str | None = None  # set when the request failed; finished is then True
    error_kind: ErrorKind | None = None
    stats: dict | None = None  # the replica's engine stats, on the final chunk
    replica_id: str = ""
    # PD: the prefill's chunk carries kv_bytes; a decode replica's first chunk carries the
    # hand-off (KV fetch + import into its pool) and whether the KV was lost and recomputed.
    handoff_ms: float | None = None
    kv_bytes: int = 0
    kv_recomputed: bool = False

    def absorb(self, later: ReplicaChunk) -> None:
        """Appends a later chunk of the same request (a stream folded into fewer chunks: the
        non-stream response, or outputs coalesced while the consumer was behind). The later
        chunk is left as it was."""
        self.steps = self.steps + later.steps
        self.finished = later.finished
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        if later.error is not None:
            self.error, self.error_kind = later.error, later.error_kind
        self.stats = later.stats or self.stats
        self.replica_id = later.replica_id or self.replica_id
        if self.handoff_ms is None:
            self.handoff_ms = later.handoff_ms
        self.kv_bytes = self.kv_bytes or later.kv_bytes
        self.kv_recomputed = self.kv_recomputed or later.kv_recomputed
        mine, theirs = self.choices, later.choices
        if len(mine) == len(theirs) == 1 and mine[0].index == theirs[0].index:
            return mine[0].absorb(theirs[0])  # the common case (one choice), without a sort
        by_index = {choice.index: choice for choice in self.choices}
        for delta in later.choices:
            if delta.index not in by_index:
                by_index[delta.index] = ChoiceDelta(index=delta.index, token_ids=[], text="")
            by_index[delta.index].absorb(delta)
        self.choices = [by_index[i] for i in sorted(by_index)]

    def cut_short(self) -> ReplicaChunk:
        """This chunk, which ended its request with a timeout, as what it generated: not
        finished, its timed-out choices without a finish reason (for a caller that returns
        what it has and words the end itself, as Databricks' error_behavior "truncate")."""
        timeout = FinishReason.TIMEOUT.value
        choices = [
            replace(c, finish_reason=None) if c.finish_reason == timeout else c
            for c in self.choices
        ]
        return replace(self, choices=choices, finished=False, error=None, error_kind=None)


# -- prefill/decode disaggregation ------------------------------------------------------------


# Every streamed chunk is pickled in the replica and loaded in the ingress: as its constructor's
# arguments a chunk takes fewer bytes and is rebuilt by one call, not by a slotted dataclass's
# default state set field by field in Python (docs/performance.md, "The serving path's own lines
# and streams").
for _cls in (TokenLogprobText, ChoiceDelta, StepInfo, ReplicaChunk):
    pickled_as_arguments(_cls)


@dataclass(slots=True)
class KVTransfer:
    """A handle to one prompt's KV cache, staged by the prefill replica for a decode replica.

    `ref` is whatever the connector needs to fetch it: a Ray ObjectRef (object-store connector,
    works across nodes), or the payload itself (in-process connector, tests). The prefill
    replica has already freed its own blocks when this exists.
    """

    connector: str  # "object_store" | "local" | a device-direct connector's name
    ref: Any
    num_tokens: int
    nbytes: int
    staged_ms: float = 0.0  # device -> host copy and hand-over time on the prefill side


@dataclass(slots=True)
class PrefillResult:
    """What a prefill replica returns: the first token (as a final-looking chunk) and the KV."""

    chunk: ReplicaChunk  # one choice with exactly the first token; error/error_kind if it failed
    transfer: KVTransfer | None = None  # None when the request failed or ended at its first token
    generator_state: Any = None  # the seeded sampler's state after the first token (a tensor)
    first_text_held: bool = False  # the first token ends mid-character: its text is not out yet


@dataclass(slots=True)
class DecodeRequest:
    """What a decode replica is asked: continue `request` after the prefill's first token."""

    request: ReplicaRequest  # the same request id, params, priority and timeout as the prefill
    first_token_id: int
    transfer: KVTransfer | None  # None: recompute the prompt locally
    generator_state: Any = None
    first_text_held: bool = False
    max_output_tokens: int = 0  # output tokens in all, the first included (the PD count rule)
    elapsed_s: float = 0.0  # the request's age when decode was asked (its e2eTimeout carries on)


# -- embedding deployments ----------------------------------------------------------------


@dataclass(slots=True)
class EmbedRequest:
    """Texts to embed on one embedding endpoint. The deployment answers an `EmbedResult`, or a
    `Rejection` naming `param[i]` for an input it refuses (empty, over the model's token
    limit): refused whole, never cut, as vLLM refuses over-long embedding inputs."""

    texts: list[str]
    param: str = "input"  # the request field to name in a rejection: "input", "input[2]", ...


@dataclass(slots=True)
class EmbedResult:
    """One L2-normalised vector per text, in the request's order, and each text's token count
    (special tokens included: what usage.prompt_tokens adds up)."""

    vectors: list[list[float]]
    num_tokens: list[int]
