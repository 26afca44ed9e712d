"""pd_generate: the first token reaches the caller before decode starts; the decode request
carries what the PD rules and the hand-off need."""

from __future__ import annotations

import asyncio

from serve_app.disagg.flow import pd_generate
from serve_app.engine.params import SamplingParams
from serve_app.messages import ChoiceDelta, KVTransfer, PrefillResult, ReplicaChunk, ReplicaRequest
from serve_app.tokenizer.limits import TokenLimits

LIMITS = TokenLimits(max_seq_len=512, max_input_token_len=256, max_iter_times=64)


class FakeBackend:
    def __init__(self, finished_at_prefill: bool = False) -> None:
        self.decode_started = asyncio.Event()
        self.first_seen = asyncio.Event()
        self.decode_request = None
        self.closed = False
        self.finished_at_prefill = finished_at_prefill

    async def prefill(self, model, req):
        first = ChoiceDelta(0, [7], "a", num_output_tokens=1)
        chunk = ReplicaChunk(req.request_id, [first], finished=self.finished_at_prefill)
        transfer = None if self.finished_at_prefill else KVTransfer("local", object(), 5, 640)
        return PrefillResult(chunk, transfer, generator_state="state")

    async def decode(self, model, req):
        self.decode_request = req
        self.decode_started.set()
        try:
            await asyncio.wait_for(self.first_seen.wait(), 5)
            yield ReplicaChunk(req.request.request_id, [ChoiceDelta(0, [8], "b")], finished=True)
        finally:
            self.closed = True


def _request(max_tokens=None, timeout_s=None) -> ReplicaRequest:
    return ReplicaRequest("r1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens),
                          timeout_s=timeout_s)  # fmt: skip


def test_first_token_before_decode_starts():
    async def run():
        backend = FakeBackend()
        stream = pd_generate(backend, "demo", _request(), LIMITS)
        first = await anext(stream)
        assert first.choices[0].token_ids == [7] and not backend.decode_started.is_set()
        backend.first_seen.set()
        rest = [chunk async for chunk in stream]
        assert [c.choices[0].token_ids for c in rest] == [[8]]
        req = backend.decode_request
        assert (req.first_token_id, req.generator_state) == (7, "state")
        assert req.max_output_tokens == 65  # maxIterTimes + 1: the limit came from maxIterTimes
        assert backend.closed

    asyncio.run(run())


def test_explicit_max_tokens_and_remaining_timeout_reach_decode():
    async def run():
        backend = FakeBackend()
        backend.first_seen.set()
        chunks = [c async for c in pd_generate(backend, "demo", _request(10, 30.0), LIMITS)]
        assert len(chunks) == 2
        req = backend.decode_request
        assert req.max_output_tokens == 10
        assert 29.0 < req.request.timeout_s <= 30.0
        assert 0.0 <= req.elapsed_s < 1.0  # the e2eTimeout window carries on at decode

    asyncio.run(run())


def test_a_request_that_ends_at_prefill_never_decodes():
    async def run():
        backend = FakeBackend(finished_at_prefill=True)
        chunks = [c async for c in pd_generate(backend, "demo", _request(1), LIMITS)]
        assert len(chunks) == 1 and backend.decode_request is None

    asyncio.run(run())


def test_closing_during_decode_closes_the_decode_stream():
    async def run():
        backend = FakeBackend()
        stream = pd_generate(backend, "demo", _request(), LIMITS)
        await anext(stream)
        pending = asyncio.ensure_future(anext(stream))
        await backend.decode_started.wait()
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await stream.aclose()
        assert backend.closed

    asyncio.run(run())
