"""What the engine reports per step and per request.

Small plain dataclasses: they cross the replica's handle, so API layers can render any family's
response (token deltas, logprobs, finish reasons, and the timing facts MindIE reports). They
pickle as their constructor's arguments: the engine process sends every step's outputs to its
replica, and the default pickling of a slotted dataclass (a state dict per object) took ~3x as
long to load. On that path a step's outputs travel flatter still (`pack_step`, `serve_app.wire`).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from serve_app.engine.params import FinishReason
from serve_app.wire import flat


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives, best first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    # All output tokens so far; in a streamed output before the last, only the new ones (the
    # same as new_token_ids), and logprobs likewise: a stream needs no more, and the final
    # output has them all.
    token_ids: list[int]
    new_token_ids: list[int]  # the tokens this output adds (stream delta)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids, when asked for
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or stop string) that ended it
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepMetrics:
    """Timing of the step that produced this output's new tokens."""

    batch_size: int = 0  # sequences in the step
    queue_wait_us: float = 0.0  # waiting before the step began (since arrival / last token)
    prefill_time_ms: float | None = None  # set on the first token: arrival to first token
    decode_time_ms: float | None = None  # set on later tokens: time since the previous token
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: StepMetrics = field(default_factory=StepMetrics)
    # Requests that report only at the end (beam search, best_of > n): on the final output, the
    # timing of every step that produced tokens for it, in order; None for streamed requests.
    step_history: list[StepMetrics] | None = None
    # Prefill/decode disaggregation. On an export_kv request's final output: the prompt's KV
    # (None when the first token ended it with EOS or a stop token: nothing to continue) and the
    # seeded generator's state after the first token (None when unseeded).
    kv_payload: Any = None  # a kv_transfer.KVPayload
    generator_state: Any = None  # a torch.Generator state (CPU uint8 tensor)
    # On an imported request's first output: the time spent writing the KV into the pool.
    kv_import_ms: float | None = None


def pickled_as_arguments(cls: type) -> None:
    """Pickle cls (a slotted dataclass) as its constructor's positional arguments."""
    fields = dataclasses.fields(cls)
    assert all(f.init for f in fields), cls  # positional arguments in field order
    values = operator.attrgetter(*(f.name for f in fields))

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__


for _cls in (TokenLogprob, CompletionOutput, StepMetrics, RequestOutput):
    pickled_as_arguments(_cls)


# -- a step's outputs between the engine process and its replica -----------------------------

_pack_output, _unpack_output = flat(RequestOutput)


def pack_step(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A step's (request id, output or exception) items with each output in its flat form
    (`wire.flat`), which pickles without calling back into Python; outputs leave out their
    prompt ids (`prompt_token_ids` is None after `unpack_step`: the replica has them)."""
    packed = []
    for request_id, out in items:
        if type(out) is RequestOutput:
            out.prompt_token_ids = None
            out = _pack_output(out)
        packed.append((request_id, out))
    return packed


def unpack_step(packed: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`pack_step`'s items as they were (each output's prompt ids None)."""
    return [(rid, _unpack_output(out) if type(out) is tuple else out) for rid, out in packed]
