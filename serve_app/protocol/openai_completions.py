"""POST /v1/completions, vLLM-style as MindIE serves it (docs/apis.md#openai-completions).

Request model with its ranges and the n / best_of / use_beam_search cross-rules (they
differ between stream and non-stream), translation to a `TokenizeRequest` (text, or token ids as
vLLM accepts) and a `ReplicaRequest`, and the response / chunk renderers. Finish reasons are
OpenAI's words (stop / length) with `stop_reason` naming the stop string or token text; usage adds
MindIE's per-step `batch_size` and `queue_wait_time` (microseconds) arrays.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, PlainValidator, WithJsonSchema

from serve_app.messages import (
    ChoiceDelta,
    ReplicaChunk,
    ReplicaRequest,
    StepInfo,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol import openai_common as common
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import Range, RequestModel, Stop
from serve_app.protocol.pd_refusals import refuse_in_pd
from serve_app.protocol.sampling import openai_finish, sampling_params

MAX_PROMPT_CHARS = 4 * 1024 * 1024  # a text prompt has 1 to 4194304 characters
_PROMPT_RULE = (
    f"must be a non-empty string of at most {MAX_PROMPT_CHARS} characters (4 MB) "
    "or a non-empty list of token ids"
)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str) and 0 < len(value) <= MAX_PROMPT_CHARS:
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    raise ValueError(_PROMPT_RULE)


Prompt = Annotated[
    str | list[int],
    PlainValidator(_prompt),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS},
                {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            ]
        }
    ),
]


class CompletionRequest(RequestModel):
    model: str = Field(description="The served model name (ModelConfig.modelName).")
    prompt: Prompt = Field(description="Text (<= 4 MB characters) or a list of token ids.")
    use_beam_search: bool | None = Field(False, description="n sequences by beam search.")
    best_of: common.NumSeqs = Field(None, description="[1, 128]; sequences run, n returned.")
    n: common.NumSeqs = Field(None, description="[1, 128] sequences returned, default 1.")
    logprobs: Annotated[int | None, Range(0, 5)] = Field(
        None, description="[0, 5] most likely alternatives per token, besides the chosen one."
    )
    max_tokens: common.MaxTokens = Field(
        None, description="(0, 2147483647]; at most maxIterTimes tokens come out."
    )
    seed: common.Seed = Field(None, description="(0, 18446744073709551615]; absent: random.")
    stop: Stop = Field(None, description="A string (1..32768) or a list of strings.")
    stream: bool | None = Field(False, description="Server-sent events, ending in [DONE].")
    stream_options: common.StreamOptions | None = Field(
        None, description="Accepted; usage is always on the final chunk (MindIE)."
    )
    repetition_penalty: common.RepetitionPenalty = Field(None, description="(0.0, 2.0].")
    presence_penalty: common.Penalty = Field(None, description="[-2.0, 2.0], default 0.0.")
    frequency_penalty: common.Penalty = Field(None, description="[-2.0, 2.0], default 0.0.")
    temperature: Annotated[float | None, Range(0.0)] = Field(
        None, description=">= 0.0; 0 is greedy. Default 1.0."
    )
    top_p: Annotated[float | None, Range(1e-6, 1.0, low_open=True)] = Field(
        None, description="(1e-6, 1.0], default 1.0."
    )
    top_k: common.TopK = Field(None, description="-1 (off) or (0, 2147483647].")
    stop_token_ids: list[int] | None = Field(None, description="Ids outside int32 are ignored.")
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    priority: common.Priority = Field(None, description="[1, 5], 1 first; default 5.")
    stream_interval: common.StreamInterval = Field(
        None,
        description="[1, 2147483647] tokens per streamed chunk (vLLM's), the first and last "
        "chunks at once; raises the server's streamInterval, never lowers it.",
    )

    def check(self, pd_mode: bool) -> None:
        """The PD refusals first, then the cross-rules (400 naming the parameter)."""
        beam, n, best_of = bool(self.use_beam_search), self.n, self.best_of
        refuse_in_pd(
            pd_mode,
            {
                "stop": bool(self.stop),
                "include_stop_str_in_output": bool(self.include_stop_str_in_output),
                "n": (n or 1) > 1,
                "best_of": (best_of or 1) > 1,
                "use_beam_search": beam,
                "logprobs": self.logprobs is not None,
            },
        )
        if beam and self.stop:
            raise invalid("stop", "cannot be used with use_beam_search")
        # n > 1 needs temperature > 0, beam search or not; beam search only lifts the checks
        # on best_of (docs/apis.md#deliberate-choices).
        if (n or 1) > 1 and self.temperature == 0:
            raise invalid("temperature", "must be > 0 when n > 1, got 0")
        if not beam:
            if (best_of or 1) > 1 and self.temperature == 0:
                raise invalid("temperature", "must be > 0 when best_of > 1, got 0")
            if self.stream and best_of is not None and n is None:
                raise invalid("best_of", "cannot be set without n when stream is true")
            if self.stream and best_of is not None and best_of != n:
                raise invalid(
                    "best_of", f"must be equal to n ({n}) when stream is true, got {best_of}"
                )
            if best_of is not None and n is not None and best_of < n:
                raise invalid("best_of", f"must be >= n ({n}), got {best_of}")

    @property
    def fake_stream(self) -> bool:
        """Beam search streams as a "fake stream": every finished choice in one event."""
        return bool(self.stream and self.use_beam_search)

    def tokenize_request(self, model: str) -> TokenizeRequest:
        if isinstance(self.prompt, list):
            return TokenizeRequest(model=model, kind="token_ids", token_ids=self.prompt)
        return TokenizeRequest(model=model, kind="completion", text=self.prompt)

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        beam, n = bool(self.use_beam_search), self.n or 1
        # Beam search: best_of is not checked; it widens the beam, never below n.
        best_of = max(n, self.best_of or n) if beam else self.best_of
        params = sampling_params(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=defaults.limits.max_output_tokens(self.max_tokens),
            n=n,
            best_of=best_of,
            use_beam_search=beam,
            ignore_eos=bool(self.ignore_eos),
            stop_token_ids=self.stop_token_ids,
            logprobs=self.logprobs,
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
            stream=bool(self.stream) and not beam,
            token_texts=self.logprobs is not None,
            logprob_texts=self.logprobs is not None,
        )


# -- responses --------------------------------------------------------------------------------


def completion_logprobs(delta: ChoiceDelta, offset: int) -> dict:
    """vLLM's completion logprobs; top_logprobs maps the chosen token, then the top N, to its
    logprob. A token the engine reported no logprob for (beam search) gets null entries."""
    out: dict[str, list] = {key: [] for key in ("text_offset", "token_logprobs", "tokens")}
    out["top_logprobs"] = []
    logprobs, texts = delta.logprobs or [], delta.token_texts or []
    for i in range(len(delta.token_ids)):
        if i < len(logprobs):
            lp = logprobs[i]
            token, top = lp.token, {lp.token: lp.logprob}
            for _, text, value in lp.top:
                top.setdefault(text, value)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        else:
            token = texts[i] if i < len(texts) else ""
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        out["tokens"].append(token)
        offset += len(token)
    return out


def _choice(delta: ChoiceDelta, logprobs: dict | None) -> dict:
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": logprobs,
        "stop_reason": delta.stop_reason if delta.finish_reason is not None else None,
        "finish_reason": openai_finish(delta.finish_reason),
    }


def completion_usage(prompt_tokens: int, completion_tokens: int, steps: list[StepInfo]) -> dict:
    return {
        **common.usage(prompt_tokens, completion_tokens),
        "batch_size": [step.batch_size for step in steps],
        "queue_wait_time": [int(round(step.queue_wait_us)) for step in steps],
    }


def completion_response(
    request_id: str, created: int, model: str, chunk: ReplicaChunk, prompt_tokens: int,
    want_logprobs: bool,
) -> dict:  # fmt: skip
    """The non-stream body (also the one event of a beam-search "fake stream").

    text_offset runs on from one choice to the next, as MindIE's documented examples show
    (choice 1 starts where choice 0's text ends; docs/apis.md#deliberate-choices)."""
    choices, offset = [], 0
    for delta in chunk.choices:
        logprobs = completion_logprobs(delta, offset) if want_logprobs else None
        offset += len(delta.text)
        choices.append(_choice(delta, logprobs))
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": completion_usage(
            prompt_tokens, sum(c.num_output_tokens for c in chunk.choices), chunk.steps
        ),
    }


class CompletionStream:
    """Replica chunks -> one event per choice delta; the last event of the final replica chunk
    carries usage, whatever stream_options says, as MindIE does
    (docs/apis.md#deliberate-choices)."""

    def __init__(
        self, request_id: str, created: int, model: str, prompt_tokens: int, want_logprobs: bool
    ) -> None:
        self.head = {"id": request_id, "object": "text_completion", "created": created}
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.want_logprobs = want_logprobs
        self.offsets: dict[int, int] = {}  # per choice: characters of its tokens so far
        self.num_tokens: dict[int, int] = {}
        self.steps: list[StepInfo] = []

    def events(self, chunk: ReplicaChunk) -> list[dict]:
        self.steps.extend(chunk.steps)
        out = []
        for delta in chunk.choices:
            self.num_tokens[delta.index] = delta.num_output_tokens
            logprobs = None
            if self.want_logprobs:
                logprobs = completion_logprobs(delta, self.offsets.get(delta.index, 0))
                self.offsets[delta.index] = sum(map(len, logprobs["tokens"])) + (
                    self.offsets.get(delta.index, 0)
                )
            if delta.token_ids or delta.text or delta.finish_reason is not None:
                choices = [_choice(delta, logprobs)]
                out.append({**self.head, "model": self.model, "choices": choices})
        if chunk.finished:
            tokens = sum(self.num_tokens.values())
            if not out:
                out.append({**self.head, "model": self.model, "choices": []})
            out[-1]["usage"] = completion_usage(self.prompt_tokens, tokens, self.steps)
        return out
