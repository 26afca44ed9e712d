"""MindIE's own inference API (`/infer`, `/infer_token`): request models and responses.

Place in the request path: the ingress validates the body with `InferRequest`, turns it into a
`TokenizeRequest` + `ReplicaRequest`, and renders the replica's chunks with `infer_response` (one
JSON object) or `InferStream` (SSE events). Ranges are MindIE's, field by field
(docs/apis.md#mindie-infer-and-infer_token); messages name the parameter and its range
("parameters.temperature must be > 0.0, got 0.0").

Choices where MindIE's documentation is silent or self-contradictory
(docs/apis.md#deliberate-choices):
- `timeout` is documented as "uint64_t (0, 3600]"; we also accept a fractional number of seconds
  in the same range (a superset: no valid MindIE request is refused, and tests can use 0.05 s).
- `seed` absent: the server draws one and reports it in `details.seed`, so any sampled answer
  can be reproduced (MindIE's example reports a seed the request did not give).
- The last stream event carries the last token's id with `"text": null`, its text only inside
  `generated_text` (exactly MindIE's example). When the final chunk has no token (a request
  ended by stopInfer after its last token event), the last event's `token` is null.
"""

from __future__ import annotations

import secrets
from typing import Annotated, ClassVar

from pydantic import Field, PrivateAttr

from serve_app.messages import (
    ChoiceDelta,
    ErrorKind,
    ReplicaChunk,
    ReplicaRequest,
    StepInfo,
    TokenizedPrompt,
    TokenizeRequest,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError
from serve_app.protocol.fields import INT32_MAX, UINT64_MAX, Range, RequestModel
from serve_app.protocol.sampling import mindie_finish, parameters_request
from serve_app.tokenizer.limits import DEFAULT_MAX_NEW_TOKENS

# A server-drawn seed stays below 2^31 so that every client (and JSON in JavaScript) reads it.
_SERVER_SEED_HIGH = 2**31 - 1


class InferParameters(RequestModel):
    """`parameters` of /infer and /infer_token; null means "not given"."""

    temperature: Annotated[float | None, Range(0.0, low_open=True)] = Field(
        None, description="> 0.0, default 1.0. Higher is more random."
    )
    top_k: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="(0, 2147483647]; >= vocabSize means no top-k cut."
    )
    top_p: Annotated[float | None, Range(0.0, 1.0, low_open=True, high_open=True)] = Field(
        None, description="(0.0, 1.0); absent means 1.0 (off), which cannot be sent explicitly."
    )
    max_new_tokens: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="(0, 2147483647], default 20; the output is <= min(maxIterTimes, this)."
    )
    do_sample: bool | None = Field(None, description="false: greedy, whatever the temperature.")
    seed: Annotated[int | None, Range(0, UINT64_MAX, low_open=True)] = Field(
        None, description="(0, 18446744073709551615]; absent: the server draws one (details.seed)."
    )
    repetition_penalty: Annotated[float | None, Range(0.0, low_open=True)] = Field(
        None, description="> 0.0, default 1.0; < 1 rewards repetition, > 1 penalises it."
    )
    details: bool | None = Field(None, description="Return finish_reason, token count and seed.")
    typical_p: Annotated[float | None, Range(0.0, 1.0, low_open=True)] = Field(
        None, description="(0.0, 1.0]; validated and accepted, not applied."
    )
    watermark: bool | None = Field(None, description="Accepted, not applied.")
    priority: Annotated[int | None, Range(1, 5)] = Field(
        None, description="[1, 5], default 5; 1 is the highest priority."
    )
    timeout: Annotated[float | None, Range(0, 3600, low_open=True)] = Field(
        None, description="(0, 3600] seconds, default 600; the request ends with a 500 after it."
    )


class InferRequest(RequestModel):
    """Body of /infer (`inputs`) and /infer_token (`input_id`); each route takes either, and
    names its own field (`primary`) when neither is given."""

    primary: ClassVar[str] = "inputs"

    inputs: str | None = Field(None, description="The prompt text (/infer).")
    input_id: list[int] | None = Field(
        None, description="Prompt token ids (/infer_token), each within the model vocabulary."
    )
    stream: bool | None = Field(None, description="true: SSE token events; default false.")
    parameters: InferParameters | None = Field(None, description="Post-processing parameters.")
    _seed: int | None = PrivateAttr(None)

    @property
    def params(self) -> InferParameters:
        return self.parameters or InferParameters()

    def prompt(self, primary: str | None = None) -> tuple[str, str | list[int]]:
        """(param, value): which prompt field the request gives; exactly one is allowed."""
        primary = primary or self.primary
        if self.inputs is not None and self.input_id is not None:
            raise APIError(
                ErrorKind.VALIDATION,
                "Input conflict. Give either inputs or input_id, not both.",
                primary,
            )
        if self.inputs is not None:
            return "inputs", self.inputs
        if self.input_id is not None:
            return "input_id", self.input_id
        other = "input_id" if primary == "inputs" else "inputs"
        raise APIError(ErrorKind.VALIDATION, f"{primary} is required (or {other})", primary)

    def seed(self) -> int:
        """The request's seed, or one drawn once (reported back in details.seed)."""
        if self._seed is None:
            seed = self.params.seed
            self._seed = seed if seed is not None else secrets.randbelow(_SERVER_SEED_HIGH) + 1
        return self._seed

    # -- translation ------------------------------------------------------------------------

    def check(self, pd_mode: bool) -> None:
        """The rules across fields; nothing of this API is refused in PD mode."""
        self.prompt()

    def tokenize_request(self, model: str) -> TokenizeRequest:
        param, value = self.prompt()
        if param == "inputs":
            return TokenizeRequest(model=model, kind="text", text=value, param=param)  # type: ignore[arg-type]
        return TokenizeRequest(model=model, kind="token_ids", token_ids=value, param=param)  # type: ignore[arg-type]

    def replica_request(
        self, request_id: str, prompt: TokenizedPrompt, defaults: ServerDefaults
    ) -> ReplicaRequest:
        params, stream = self.params, bool(self.stream)
        return parameters_request(
            request_id, prompt, defaults, params, seed=self.seed(),
            max_new_tokens=max_new_tokens(params), stream=stream, token_texts=stream,
        )  # fmt: skip


class InferTokenRequest(InferRequest):
    """Body of /infer_token: the same fields, `input_id` named when no prompt is given."""

    primary: ClassVar[str] = "input_id"


def max_new_tokens(params: InferParameters) -> int:
    return DEFAULT_MAX_NEW_TOKENS if params.max_new_tokens is None else params.max_new_tokens


def details(choice: ChoiceDelta, seed: int) -> dict:
    return {
        "finish_reason": mindie_finish(choice.finish_reason),
        "generated_tokens": choice.num_output_tokens,
        "seed": seed,
    }


def infer_response(chunk: ReplicaChunk, seed: int, with_details: bool) -> dict:
    """The non-stream body: {"generated_text"} plus "details" when asked for."""
    choice = chunk.choices[0] if chunk.choices else ChoiceDelta(index=0, token_ids=[], text="")
    body: dict = {"generated_text": choice.text}
    if with_details:
        body["details"] = details(choice, seed)
    return body


class InferStream:
    """Replica chunks -> SSE payloads: one per generated token, the last one adding
    `generated_text` and `details`. Stateful across chunks of one request."""

    def __init__(self, seed: int, with_details: bool, full_text: bool = False) -> None:
        self.seed = seed
        self.with_details = with_details
        self.full_text = full_text  # ServerConfig.fullTextEnabled: token text = text so far
        self.text = ""  # stop-processed text so far (generated_text)
        self.token_text = ""  # per-token texts so far (fullTextEnabled)
        self.num_tokens = 0

    def payloads(self, chunk: ReplicaChunk) -> list[dict]:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            return [self._final(None, None, None)] if chunk.finished else []
        self.text += choice.text
        ids = choice.token_ids
        texts = choice.token_texts or [""] * len(ids)
        out = []
        for j, token_id in enumerate(ids):
            prefill, decode = self._times(chunk.steps, j, len(ids))
            self.num_tokens += 1
            if chunk.finished and j == len(ids) - 1:
                out.append(self._final(choice, token_id, (prefill, decode)))
                return out
            self.token_text += texts[j]
            text = self.token_text if self.full_text else texts[j]
            token = {"id": token_id, "text": text}
            out.append({"prefill_time": prefill, "decode_time": decode, "token": token})
        if chunk.finished:
            out.append(self._final(choice, None, None))
        return out

    def _times(self, steps: list[StepInfo], j: int, n: int) -> tuple[float | None, float | None]:
        """(prefill_time, decode_time) in ms of a chunk's j-th token: the step that made it."""
        if not steps:
            return None, None
        step = steps[j] if len(steps) == n else steps[-1]
        if self.num_tokens == 0:
            return _ms(step.prefill_time_ms), None
        return None, _ms(step.decode_time_ms)

    def _final(self, choice, token_id, times) -> dict:
        prefill, decode = times or (None, None)
        event: dict = {
            "prefill_time": prefill,
            "decode_time": decode,
            "generated_text": self.text,
        }
        if self.with_details:
            done = choice or ChoiceDelta(index=0, token_ids=[], text="", finish_reason="aborted")
            found = details(done, self.seed)
            found["generated_tokens"] = self.num_tokens
            event["details"] = found
        event["token"] = None if token_id is None else {"id": token_id, "text": None}
        return event


def _ms(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)
