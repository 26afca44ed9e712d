"""What the engine reports per step and per request.

Small plain dataclasses: they cross the replica's handle, so API layers can render any family's
response (token deltas, logprobs, finish reasons, and the timing facts MindIE reports). They
pickle as their constructor's arguments: the engine process sends every step's outputs to its
replica, and the default pickling of a slotted dataclass (a state dict per object) took ~3x as
long to load. On that path a step's streamed outputs travel flatter still (`pack_step`).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from serve_app.engine.params import FinishReason


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
#
# Pickling a RequestOutput calls back into Python for each of its three objects, on the step
# loop's time, for every stream every step. A streamed output before the last (one choice, no
# logprobs, nothing but tokens and timing) travels as a plain tuple instead, which pickle writes
# without calling Python; anything else as the (request id, item) pair it was.

_PAIR = 2  # (request id, item): an item as it is
_STREAMED = 9  # (request id, index, new token ids, cumulative logprob, *StepMetrics' 5 fields)
_metric_values = operator.attrgetter(*(f.name for f in dataclasses.fields(StepMetrics)))


def pack_step(items: list[tuple[str, Any]]) -> list[tuple]:
    """A step's (request id, output or exception) items, each as a tuple that pickles fast;
    outputs leave out their prompt ids (`prompt_token_ids` is None after `unpack_step`)."""
    packed = []
    for item in items:
        out = item[1]
        if isinstance(out, RequestOutput):
            out.prompt_token_ids = None
            if (
                len(out.outputs) == 1
                and item[0] == out.request_id
                and not out.finished
                and out.step_history is None
                and out.kv_payload is None
                and out.generator_state is None
                and out.kv_import_ms is None
            ):
                c = out.outputs[0]
                if (
                    c.token_ids is c.new_token_ids
                    and c.logprobs is None
                    and c.finish_reason is None
                    and c.stop_reason is None
                    and not c.text
                ):
                    metrics = _metric_values(out.metrics)
                    packed.append((item[0], c.index, c.token_ids, c.cumulative_logprob, *metrics))
                    continue
        packed.append(item)
    return packed


def unpack_step(packed: list[tuple]) -> list[tuple[str, Any]]:
    """`pack_step`'s items as they were (each output's prompt ids None)."""
    items = []
    for t in packed:
        if len(t) == _PAIR:
            items.append(t)
            continue
        assert len(t) == _STREAMED, len(t)
        request_id, index, tokens, cumulative, *metrics = t
        choice = CompletionOutput(index, tokens, tokens, cumulative)
        items.append(
            (request_id, RequestOutput(request_id, None, [choice], False, StepMetrics(*metrics)))
        )
    return items
