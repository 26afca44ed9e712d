"""Queue time counts from when a request reached the engine's owner, not from when the engine
loop got round to it (a long step in progress must show up as queueing, not as prefill)."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.engine import EngineConfig, SamplingParams
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.kv_transfer import ImportedPrefill
from serve_app.engine.llm_engine import LLMEngine

CONFIG = EngineConfig(
    model="demo-tiny", dtype="float32", max_seq_len=256, max_input_token_len=128,
    max_iter_times=8, max_prefill_tokens=256, block_size=16, num_kv_blocks=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(CONFIG)


def test_an_earlier_arrival_is_reported_as_queue_wait(engine):
    engine.add_request(
        EngineRequest(
            "late", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=time.monotonic() - 1.0
        )
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    metrics = outputs[-1].metrics
    assert metrics.queue_wait_us >= 1e6 and metrics.prefill_time_ms >= 1000


def test_async_engine_stamps_arrival_when_the_request_is_handed_over(engine):
    async def run():
        async_engine = AsyncEngine(engine=engine)
        try:
            request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=1))
            before = time.monotonic()
            outputs = [o async for o in async_engine.generate(request)]
            assert before <= request.arrival_time <= time.monotonic()
            assert outputs[-1].finished
        finally:
            async_engine.shutdown()

    asyncio.run(run())


def test_a_pd_decode_continues_the_requests_e2e_window(engine):
    """A decode that imports a prefill started elsewhere times out when the request's e2eTimeout
    window (begun before the prefill) runs out, not a full window after the hand-off."""
    from serve_app.engine.params import FinishReason

    began = time.monotonic() - CONFIG.e2e_timeout_s - 1.0
    engine.add_request(EngineRequest(
        "pd-old", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0),
        imported=ImportedPrefill(4, None, max_output_tokens=4), e2e_start=began,
    ))  # fmt: skip
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].finish_reason == FinishReason.TIMEOUT
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
