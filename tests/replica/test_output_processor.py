"""OutputProcessor on hand-made engine outputs: the cases the random demo model never produces."""

from __future__ import annotations

import pytest

from serve_app.engine.outputs import CompletionOutput, RequestOutput
from serve_app.engine.params import FinishReason, SamplingParams
from serve_app.messages import ReplicaRequest
from serve_app.models.loader import load_tokenizer, resolve_model_path
from serve_app.replica.output_processor import OutputProcessor

EOS = 151645  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("demo-tiny"))


@pytest.mark.parametrize("include, expect_eos_text", [(False, False), (True, True)])
def test_eos_text_is_hidden_unless_asked_even_with_special_tokens_kept(
    tokenizer, include, expect_eos_text
):
    ids = tokenizer.encode("Hello there") + [EOS]
    req = ReplicaRequest(
        "r", [1, 2, 3], SamplingParams(), stream=False, skip_special_tokens=False,
        include_stop_str_in_output=include, token_texts=True,
    )  # fmt: skip
    output = RequestOutput(
        "r", [1, 2, 3],
        [CompletionOutput(0, ids, ids, finish_reason=FinishReason.EOS)],
        finished=True,
    )  # fmt: skip
    chunk = OutputProcessor(req, tokenizer).process(output)
    choice = chunk.choices[0]
    assert choice.finish_reason == "eos" and choice.token_ids == ids
    assert ("<|im_end|>" in choice.text) == expect_eos_text
    assert choice.text.startswith("Hello there")
    assert len(choice.token_texts) == len(ids)


def _stream_of(tokenizer, ids, interval, stop=(), last_reason=FinishReason.LENGTH, n_steps=None):
    """The chunks a streamed request gets for `ids`, one engine step per token."""
    req = ReplicaRequest(
        "r", [1, 2, 3], SamplingParams(), stream=True, stop=list(stop), stream_interval=interval
    )
    processor = OutputProcessor(req, tokenizer)
    chunks = []
    steps = len(ids) if n_steps is None else n_steps
    for i in range(steps):
        last = i == len(ids) - 1
        co = CompletionOutput(
            0, ids[: i + 1], [ids[i]], finish_reason=last_reason if last else None
        )
        chunk = processor.process(RequestOutput("r", [1, 2, 3], [co], finished=last))
        if chunk is not None:
            chunks.append(chunk)
        if chunk is not None and chunk.finished:
            break
    return chunks, processor


@pytest.mark.parametrize("interval", [1, 2, 3, 4, 50])
def test_stream_interval_holds_tokens_but_not_the_first_nor_the_last(tokenizer, interval):
    ids = tokenizer.encode("one two three four five six seven eight nine ten")
    chunks, _ = _stream_of(tokenizer, ids, interval)
    sizes = [len(c.choices[0].token_ids) for c in chunks]
    assert sizes[0] == 1  # the first token is never held
    assert all(size == interval for size in sizes[1:-1])
    assert 1 <= sizes[-1] <= interval and chunks[-1].finished
    assert not any(c.finished for c in chunks[:-1])
    every, _ = _stream_of(tokenizer, ids, 1)  # the same tokens and text as token by token
    assert [t for c in chunks for t in c.choices[0].token_ids] == ids
    assert "".join(c.choices[0].text for c in chunks) == "".join(c.choices[0].text for c in every)
    assert sum(len(c.steps) for c in chunks) == len(ids)  # each step's facts kept
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_interval_ends_at_a_stop_string_with_the_held_tokens(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta")
    chunks, _ = _stream_of(tokenizer, ids, 4, stop=["delta"], last_reason=None)
    assert chunks[-1].finished and chunks[-1].choices[0].finish_reason == "stop_string"
    text = "".join(c.choices[0].text for c in chunks)
    assert text == "alpha beta gamma " and "delta" not in text


def test_stream_interval_hands_over_what_it_holds_before_a_failure(tokenizer):
    ids = tokenizer.encode("one two three four five six")
    chunks, processor = _stream_of(tokenizer, ids, 10, n_steps=4)
    assert len(chunks) == 1  # the first token; three more held
    held = processor.hold.take()
    assert held is not None and held.choices[0].token_ids == ids[1:4] and not held.finished
    assert processor.hold.take() is None


def test_stream_interval_does_not_touch_non_stream_requests(tokenizer):
    ids = tokenizer.encode("one two three")
    req = ReplicaRequest("r", [1, 2, 3], SamplingParams(), stream=False, stream_interval=2)
    processor = OutputProcessor(req, tokenizer)
    outputs = [
        RequestOutput(
            "r",
            [1, 2, 3],
            [CompletionOutput(0, ids[: i + 1], [t], FinishReason.LENGTH if i == 2 else None)],
            finished=i == 2,
        )  # fmt: skip
        for i, t in enumerate(ids[:3])
    ]
    chunks = [c for c in map(processor.process, outputs) if c is not None]
    assert len(chunks) == 1 and chunks[0].choices[0].token_ids == ids[:3]


def test_a_timeout_leaves_the_held_tokens_out_of_its_error_chunk(tokenizer):
    """The request times out while tokens are held: its final chunk (an error, which a stream
    does not render as tokens) has only the timed-out step's; hold.take() gives the rest, sent
    before it."""
    ids = tokenizer.encode("one two three four five six")
    chunks, processor = _stream_of(tokenizer, ids, 10, n_steps=4)
    timeout = CompletionOutput(0, [], [], finish_reason=FinishReason.TIMEOUT)
    final = processor.process(RequestOutput("r", [1, 2, 3], [timeout], finished=True))
    assert final.finished and final.error_kind == "timeout" and final.choices[0].token_ids == []
    held = processor.hold.take()
    assert [t for c in [*chunks, held] for t in c.choices[0].token_ids] == ids[:4]


def test_stream_interval_with_two_choices_loses_nothing_when_one_stops_early(tokenizer):
    """n = 2: choice 0 ends on a stop string while choice 1 goes on; both choices' tokens and
    finish reasons all arrive, each choice's text as a token-by-token stream's."""
    ids = tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa")
    req = ReplicaRequest(
        "r", [1, 2, 3], SamplingParams(n=2), stream=True, stop=["gamma"], stream_interval=3
    )
    processor, chunks = OutputProcessor(req, tokenizer), []
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    other = tokenizer.encode(words)[: len(ids)]  # choice 1 never meets the stop string
    assert len(other) == len(ids)
    for i in range(len(ids)):
        last = i == len(ids) - 1
        reason = FinishReason.LENGTH if last else None
        outputs = [
            CompletionOutput(0, ids[: i + 1], [ids[i]], finish_reason=reason),
            CompletionOutput(1, other[: i + 1], [other[i]], finish_reason=reason),
        ]
        chunk = processor.process(RequestOutput("r", [1, 2, 3], outputs, finished=last))
        if chunk is not None:
            chunks.append(chunk)
    assert chunks[-1].finished
    deltas = {0: [], 1: []}
    for chunk in chunks:
        for delta in chunk.choices:
            deltas[delta.index].append(delta)
    assert "".join(d.text for d in deltas[0]) == "alpha beta "
    assert [d.finish_reason for d in deltas[0] if d.finish_reason] == ["stop_string"]
    assert [t for d in deltas[1] for t in d.token_ids] == other
    assert [d.finish_reason for d in deltas[1] if d.finish_reason] == ["length"]


class _Link:
    """Stands in for a token socket link: records what is put; `alive` as the test sets it."""

    def __init__(self) -> None:
        self.alive, self.put_chunks = True, []

    def put(self, chunk, now=False) -> None:
        self.put_chunks.append(chunk)


def test_a_link_that_closed_ends_the_request_even_while_chunks_are_held(tokenizer):
    """Relay: the ingress's socket closes while stream_interval holds the request's chunks;
    the very next output ends the request (and so frees its blocks), not the next release."""
    import asyncio

    from serve_app.replica.relay import SOCKET_CLOSED, Relay

    ids = tokenizer.encode("one two three four five six")
    req = ReplicaRequest("r", [1, 2, 3], SamplingParams(), stream=True, stream_interval=1000)

    def output(i):
        return RequestOutput("r", [1, 2, 3], [CompletionOutput(0, ids[: i + 1], [ids[i]])])

    async def run():
        link = _Link()
        relay = Relay(OutputProcessor(req, tokenizer), link)
        relay.take(output(0))  # the first chunk goes at once
        relay.take(output(1))  # held
        link.alive = False
        relay.take(output(2))
        return link, relay

    link, relay = asyncio.run(run())
    assert [c.choices[0].token_ids for c in link.put_chunks] == [ids[:1]]
    final = relay.final.result()
    assert final.finished and final.error == SOCKET_CLOSED
