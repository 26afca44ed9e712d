"""Triton's generate extension as MindIE serves it: request model and responses.

Place in the request path: `/v2/models/{model}[/versions/{v}]/generate(_stream)` validate the
body with `GenerateRequest`, and render the replica's chunks with `generate_response` (one JSON
object) or `GenerateStream` (one SSE event per chunk, text deltas in `text_output`).

Ranges (docs/apis.md#triton-generate). Triton leaves parameters to the model; we use MindIE's
/infer ranges with two deliberate differences, because Triton clients (Triton's own example
sends `"temperature": 0`) expect the usual LLM conventions (docs/apis.md#deliberate-choices):
- temperature >= 0.0, where 0 means greedy (MindIE /infer refuses 0);
- top_p in (0.0, 1.0], where 1.0 means off (MindIE /infer refuses an explicit 1.0).
Everything else: top_k (0, 2^31-1], max_tokens / max_new_tokens (0, 2^31-1] default 20 (both
may be given only if equal), seed (0, 2^64-1], repetition_penalty > 0, typical_p (0, 1] and
watermark accepted but not applied, batch_size >= 1 and perf_stat accepted (MindIE's knobs; the
details always report the real batch sizes), priority [1, 5] default 5, timeout (0, 3600] s
default 600, stop a string of 1..32768 characters or a list of them (32768 characters in all;
the completions rule); TensorRT-LLM's stop_words (more stop strings) and bad_words (words kept out
of the output), each a string or a list of strings where "" means none. Unknown parameters are
ignored, as Triton allows model-specific ones.

Triton passes any other attribute of the request object on as a parameter, and TensorRT-LLM's
clients send their parameters that way (`{"text_input", "max_tokens", "bad_words", ...}`): every
parameter may be given at the top level or inside `parameters`, with the same ranges; given in
both places, the values must agree.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PlainValidator, PrivateAttr

from serve_app.messages import (
    ErrorKind,
    ReplicaChunk,
    ReplicaRequest,
    StepInfo,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError
from serve_app.protocol.fields import (
    INT32_MAX,
    STOP_SCHEMA,
    UINT64_MAX,
    Range,
    RequestModel,
    Words,
    stop_strings,
)
from serve_app.protocol.pd_refusals import refuse_in_pd
from serve_app.protocol.sampling import mindie_finish, parameters_request
from serve_app.structured.banned_words import BannedWords
from serve_app.tokenizer.limits import DEFAULT_MAX_NEW_TOKENS


def _checked_stop(value: object) -> object:
    stop_strings(value)  # the rule of the OpenAI routes (shared); the value is kept
    return value


class GenerateParameters(RequestModel):
    """`parameters` of the generate request; null means "not given"."""

    stream: bool | None = Field(None, description="Accepted; the URL decides (generate_stream).")
    temperature: Annotated[float | None, Range(0.0)] = Field(
        None, description=">= 0.0, default 1.0; 0 means greedy."
    )
    max_tokens: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="(0, 2147483647], default 20; capped at maxIterTimes."
    )
    max_new_tokens: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="Same as max_tokens (MindIE's name); give one, or both equal."
    )
    top_k: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="(0, 2147483647]; >= vocabSize means no top-k cut."
    )
    top_p: Annotated[float | None, Range(0.0, 1.0, low_open=True)] = Field(
        None, description="(0.0, 1.0], default 1.0 (off)."
    )
    do_sample: bool | None = Field(None, description="false: greedy, whatever the temperature.")
    seed: Annotated[int | None, Range(0, UINT64_MAX, low_open=True)] = Field(
        None, description="(0, 18446744073709551615]; the same seed gives the same output."
    )
    repetition_penalty: Annotated[float | None, Range(0.0, low_open=True)] = Field(
        None, description="> 0.0, default 1.0."
    )
    typical_p: Annotated[float | None, Range(0.0, 1.0, low_open=True)] = Field(
        None, description="(0.0, 1.0]; accepted, not applied."
    )
    watermark: bool | None = Field(None, description="Accepted, not applied.")
    details: bool | None = Field(None, description="Add MindIE's details object.")
    batch_size: Annotated[int | None, Range(1, INT32_MAX)] = Field(
        None, description="Accepted (MindIE); details report the engine's real batch sizes."
    )
    perf_stat: bool | None = Field(None, description="Accepted (MindIE); details carry timings.")
    priority: Annotated[int | None, Range(1, 5)] = Field(
        None, description="[1, 5], default 5; 1 is the highest priority."
    )
    timeout: Annotated[float | None, Range(0, 3600, low_open=True)] = Field(
        None, description="(0, 3600] seconds, default 600."
    )
    stop: Annotated[str | list[str] | None, PlainValidator(_checked_stop), STOP_SCHEMA] = Field(
        None, description="Stop strings: 1..32768 characters each, 32768 in all."
    )
    stop_words: Words = Field(
        None, description='More stop strings (TensorRT-LLM\'s name); "" means none.'
    )
    bad_words: Words = Field(
        None, description='Words kept out of the output (TensorRT-LLM\'s name); "" means none.'
    )

    @property
    def stop_list(self) -> list[str]:
        """stop and stop_words together, each string once."""
        both = (stop_strings(self.stop) or []) + (self.stop_words or [])
        return list(dict.fromkeys(both))

    def output_tokens(self) -> int:
        """max_tokens or max_new_tokens (20 when neither): both may be given only if equal."""
        a, b = self.max_tokens, self.max_new_tokens
        if a is not None and b is not None and a != b:
            raise APIError(
                ErrorKind.VALIDATION,
                f"parameters.max_tokens ({a}) and parameters.max_new_tokens ({b}) conflict; "
                "give one of them",
                "parameters.max_tokens",
            )
        chosen = a if a is not None else b
        return DEFAULT_MAX_NEW_TOKENS if chosen is None else chosen


class GenerateRequest(GenerateParameters):
    """Body of generate / generate_stream. Every parameter may also be given at the top level
    (the fields inherited from GenerateParameters, validated and named there); `params` is the
    two merged. Other top-level keys are ignored."""

    id: str | None = Field(
        None, description="Any string; echoed back, and stopInfer {id} stops the request."
    )
    text_input: str = Field(description="The prompt text.")
    parameters: GenerateParameters | None = Field(None, description="Generation parameters.")
    _params: GenerateParameters | None = PrivateAttr(None)

    @property
    def params(self) -> GenerateParameters:
        """The top-level parameters and `parameters` as one; a name given in both places with
        different values is refused, naming it."""
        if self._params is None:
            inner, merged = self.parameters, {}
            for name in GenerateParameters.model_fields:
                top = getattr(self, name)
                nested = None if inner is None else getattr(inner, name)
                if top is not None and nested is not None and top != nested:
                    raise APIError(
                        ErrorKind.VALIDATION,
                        f"{name} ({top!r}) and parameters.{name} ({nested!r}) conflict; give it "
                        "once, at the top level or in parameters",
                        name,
                    )
                merged[name] = top if top is not None else nested
            self._params = GenerateParameters.model_construct(**merged)
        return self._params

    # -- translation ------------------------------------------------------------------------

    def check(self, pd_mode: bool) -> None:
        """PD refusals first, then the rules across fields."""
        inner = self.parameters or GenerateParameters()
        stop = stop_strings(self.stop) or stop_strings(inner.stop)
        refuse_in_pd(
            pd_mode, {"stop": bool(stop), "stop_words": bool(self.stop_words or inner.stop_words)}
        )
        self.params.output_tokens()

    def tokenize_request(self, model: str) -> TokenizeRequest:
        return TokenizeRequest(model=model, kind="text", text=self.text_input, param="text_input")

    def replica_request(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        defaults: ServerDefaults,
        *,
        stream: bool = False,
    ) -> ReplicaRequest:
        """stream: the route's (generate_stream), not parameters.stream."""
        params = self.params
        req = parameters_request(
            request_id, prompt, defaults, params, seed=params.seed,
            max_new_tokens=params.output_tokens(), stop=params.stop_list, stream=stream,
        )  # fmt: skip
        if params.bad_words:
            req.params.constraint = BannedWords(tuple(params.bad_words))
        return req


class Head:
    """The fields every response and stream event repeats."""

    def __init__(self, request_id: str | None, model: str, version: str) -> None:
        self.fields: dict = {} if request_id is None else {"id": request_id}
        self.fields.update(model_name=model, model_version=version)


def details(finish_reason: str | None, num_tokens: int, steps: list[StepInfo]) -> dict:
    """MindIE's details: per-token engine facts (ms for costs, microseconds for queue wait)."""
    decode = [round(s.decode_time_ms, 2) for s in steps if s.decode_time_ms is not None]
    first = next((s.prefill_time_ms for s in steps if s.prefill_time_ms is not None), None)
    return {
        "finish_reason": mindie_finish(finish_reason),
        "generated_tokens": num_tokens,
        "first_token_cost": None if first is None else round(first, 2),
        "decode_cost": decode,
        "batch_size": [s.batch_size for s in steps],
        "queue_wait_time": [round(s.queue_wait_us, 2) for s in steps],
    }


def generate_response(head: Head, chunk: ReplicaChunk, with_details: bool) -> dict:
    choice = chunk.choices[0] if chunk.choices else None
    body = {**head.fields, "text_output": choice.text if choice else ""}
    if with_details:
        reason = choice.finish_reason if choice else "aborted"
        body["details"] = details(reason, choice.num_output_tokens if choice else 0, chunk.steps)
    return body


class GenerateStream:
    """Replica chunks -> generate_stream events: the text delta of each chunk, details last."""

    def __init__(self, head: Head, with_details: bool) -> None:
        self.head = head
        self.with_details = with_details
        self.steps: list[StepInfo] = []
        self.num_tokens = 0

    def payloads(self, chunk: ReplicaChunk) -> list[dict]:
        event = self.payload(chunk)
        return [] if event is None else [event]

    def payload(self, chunk: ReplicaChunk) -> dict | None:
        choice = chunk.choices[0] if chunk.choices else None
        self.steps.extend(chunk.steps)
        if choice is not None:
            self.num_tokens = max(self.num_tokens, choice.num_output_tokens)
        text = choice.text if choice else ""
        if not chunk.finished and not text and not (choice and choice.token_ids):
            return None
        event = {**self.head.fields, "text_output": text}
        if chunk.finished and self.with_details:
            reason = choice.finish_reason if choice else "aborted"
            event["details"] = details(reason, self.num_tokens, self.steps)
        return event
