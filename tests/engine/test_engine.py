"""The engine end to end on the demo models: parity with transformers, scheduling, KV lifetime."""

import asyncio
import time

import pytest
import torch
from engine_helpers import (
    assert_idle,
    assert_matches_transformers,
    tokens,
)

from serve_app.engine import (
    LLM,
    AsyncEngine,
    EngineError,
    EngineRequest,
    FinishReason,
    RequestRejected,
    SamplingParams,
)
from serve_app.engine.kv_transfer import ImportedPrefill

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

GREEDY16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
GREEDY16_LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def make_llm(model="demo", **overrides):
    settings = dict(
        dtype="float32",
        block_size=16,
        num_kv_blocks=256,
        max_seq_len=1024,
        max_iter_times=256,
        max_input_token_len=512,
        max_prefill_tokens=512,
    )
    settings.update(overrides)
    return LLM(model, **settings)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def tiny():
    """The engine on the tiny demo model, for the tests of scheduling and sampling that compare
    the engine with itself rather than with transformers (the model's numerics are not theirs
    to check)."""
    return make_llm("demo-tiny")


def test_greedy_matches_transformers_with_chunked_prefill(prompts, hf_greedy):
    # A 48-token budget per step splits the longer prompts over several steps, next to decodes.
    llm = make_llm(max_prefill_tokens=48, max_input_token_len=48)
    outputs = llm.generate(prompts, GREEDY16_LOGPROBS)
    assert_matches_transformers(outputs, hf_greedy)
    assert all(o.outputs[0].finish_reason == FinishReason.LENGTH for o in outputs)
    assert_idle(llm)


def test_greedy_matches_transformers_in_one_batch(llm, prompts, hf_greedy):
    assert_matches_transformers(llm.generate(prompts, GREEDY16_LOGPROBS), hf_greedy)
    assert_idle(llm)


def test_prompts_of_one_length_prefill_unpadded_and_match_transformers(llm, hf_demo, hf_greedy_of):
    # fresh prompts of one length are attended as they are packed (no padding, no gather); the
    # decode steps after it read the KV that prefill wrote (4 tokens: each step reads it all)
    generator = torch.Generator().manual_seed(7)
    same = [torch.randint(0, 151643, (40,), generator=generator).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outputs = llm.generate(same, params)
    assert_matches_transformers(outputs, hf_greedy_of(hf_demo, same, 4))
    assert_idle(llm)


def test_bfloat16_gives_the_same_greedy_tokens(prompts, greedy_reference):
    llm = make_llm(dtype="bfloat16")  # the demo model's greedy margins survive bf16 rounding
    assert tokens(llm.generate(prompts, GREEDY16)) == greedy_reference


def test_preemption_when_the_pool_is_too_small_keeps_outputs_exact(prompts, hf_greedy):
    llm = make_llm(num_kv_blocks=18)  # far fewer blocks than all requests need at once
    outputs = llm.generate(prompts, GREEDY16_LOGPROBS)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert_matches_transformers(outputs, hf_greedy)
    assert_idle(llm)


def test_prefix_reuse_gives_identical_outputs_and_reuses_blocks(llm, prompts, hf_greedy):
    # their full blocks cached, whatever ran before (filled by the prefill: one token will do)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    before = llm.engine.stats()["prefix_cache_hits"]
    assert_matches_transformers(llm.generate(prompts, GREEDY16_LOGPROBS), hf_greedy)
    hits = llm.engine.stats()["prefix_cache_hits"] - before
    full_blocks = sum((len(p) - 1) // 16 for p in prompts)
    assert hits >= full_blocks > 0
    assert_idle(llm)


def test_abort_mid_generation_frees_every_block(llm, prompts):
    engine = llm.engine
    engine.add_request(
        EngineRequest("a", prompts[6], SamplingParams(temperature=0, max_tokens=100))
    )
    engine.add_request(
        EngineRequest("b", prompts[7], SamplingParams(temperature=1.0, n=3, max_tokens=100))
    )
    for _ in range(5):
        engine.step()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_blocks"]
    for request_id in ("a", "b"):
        final = engine.abort(request_id)
        assert final.finished
        assert {c.finish_reason for c in final.outputs} == {FinishReason.ABORTED}
    assert engine.abort("a") is None
    assert_idle(llm)


def test_same_seed_same_tokens_alone_and_in_a_busy_batch(tiny, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = tokens(tiny.generate([prompts[4]], seeded))[0]
    # the others sample (unseeded) beside it at every one of its steps
    busy = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 6
    batch = tiny.generate(prompts[:6] + [prompts[4]], busy + [seeded])
    assert tokens(batch)[-1] == alone
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=12, ignore_eos=True)
    assert tokens(tiny.generate([prompts[4]], other))[0] != alone


def test_temperature_zero_equals_greedy(llm, prompts, greedy_reference):
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, max_tokens=16, ignore_eos=True)
    assert tokens(llm.generate(prompts[:3], params)) == greedy_reference[:3]


def test_n_and_best_of_return_the_right_number_of_sequences(tiny, prompts):
    out = tiny.generate([prompts[3]], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert all(
        len(c.token_ids) == 8 or c.finish_reason != FinishReason.LENGTH for c in out[0].outputs
    )
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # the forks sample apart
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=1, max_tokens=8)
    best = tiny.generate([prompts[3]], params)[0].outputs
    assert len(best) == 2
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert_idle(tiny)


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(llm, hf_demo, prompts, width):
    ids = prompts[3]
    params = SamplingParams(
        n=width, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True
    )
    ours = [c.token_ids for c in llm.generate([ids], params)[0].outputs]
    with torch.inference_mode():
        ref = hf_demo.generate(
            torch.tensor([ids]),
            max_new_tokens=6,
            min_new_tokens=6,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
        )
    assert ours == ref[:, len(ids) :].tolist()
    assert_idle(llm)


def test_beam_search_returns_n_of_best_of_beams(llm, prompts):
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0, max_tokens=5)
    out = llm.generate([prompts[2]], params)[0].outputs
    assert len(out) == 2
    assert_idle(llm)


def test_stop_token_ids_and_eos(llm, prompts, greedy_reference):
    stop = greedy_reference[2][3]
    out = llm.generate(
        [prompts[2]], SamplingParams(temperature=0, stop_token_ids=[stop], max_tokens=16)
    )[0].outputs[0]
    cut = greedy_reference[2].index(stop) + 1
    assert out.token_ids == greedy_reference[2][:cut]
    assert (out.finish_reason, out.stop_reason) == (FinishReason.STOP_TOKEN, stop)
    eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = eos | {stop}
    try:
        out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=16))
        assert out[0].outputs[0].finish_reason == FinishReason.EOS
        assert out[0].outputs[0].token_ids == greedy_reference[2][:cut]
        ignored = llm.generate([prompts[2]], GREEDY16)[0].outputs[0]
        assert ignored.token_ids == greedy_reference[2]
    finally:
        llm.engine.eos_token_ids = eos


def test_output_limits_max_tokens_max_iter_times_and_max_seq_len(prompts):
    llm = make_llm("demo-tiny", max_iter_times=10, max_seq_len=110)
    free = SamplingParams(temperature=0, ignore_eos=True)
    assert len(tokens(llm.generate([prompts[2]], free))[0]) == 10  # maxIterTimes
    limited = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    assert len(tokens(llm.generate([prompts[2]], limited))[0]) == 4  # max_tokens
    out = llm.generate([prompts[6]], free)[0].outputs[0]  # 100 prompt tokens + 10 = maxSeqLen
    assert len(out.token_ids) == 10 and out.finish_reason == FinishReason.LENGTH
    out = llm.generate([prompts[7][:105]], free)[0].outputs[0]  # 105 + 5 = maxSeqLen, first
    assert len(out.token_ids) == 5 and out.finish_reason == FinishReason.LENGTH


def test_bad_input_is_refused_with_a_clear_error(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[151936]], GREEDY16)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY16)
    with pytest.raises(ValueError, match="prompt has 1024 tokens"):
        llm.generate([[1] * 1024], GREEDY16)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[1]], GREEDY16, priorities=[0])
    with pytest.raises(ValueError, match="KV blocks"):
        make_llm("demo-tiny", num_kv_blocks=4).generate([[1] * 100], GREEDY16)
    assert_idle(llm)


def test_priority_orders_admission(prompts):
    llm = make_llm("demo-tiny", max_batch_size=1, max_prefill_batch_size=1)
    engine = llm.engine
    for name in ("low1", "low2"):
        engine.add_request(
            EngineRequest(name, prompts[1], SamplingParams(temperature=0, max_tokens=2), 5)
        )
    engine.add_request(
        EngineRequest("urgent", prompts[1], SamplingParams(temperature=0, max_tokens=2), 1)
    )
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "low1", "low2"]


def test_deadline_times_out_and_frees_blocks(llm, prompts):
    engine = llm.engine
    engine.add_request(
        EngineRequest(
            "slow",
            prompts[5],
            SamplingParams(temperature=0, max_tokens=200),
            deadline=time.monotonic() + 0.2,
        )
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        time.sleep(0.01)
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == FinishReason.TIMEOUT
    assert_idle(llm)


def test_outputs_carry_step_timing(llm, prompts):
    engine = llm.engine
    engine.add_request(EngineRequest("t", prompts[3], SamplingParams(temperature=0, max_tokens=3)))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    first, later = outputs[0].metrics, outputs[1].metrics
    assert first.prefill_time_ms > 0 and first.decode_time_ms is None
    assert later.decode_time_ms > 0 and later.prefill_time_ms is None
    assert first.batch_size >= 1 and first.queue_wait_us >= 0
    assert [o.outputs[0].new_token_ids for o in outputs] == [
        [t] for t in outputs[-1].outputs[0].token_ids
    ]


def test_async_engine_streams_and_aborts_on_early_exit(llm, prompts, greedy_reference):
    engine = AsyncEngine(engine=llm.engine)

    async def main():
        streamed = []
        request = EngineRequest("s1", prompts[2], GREEDY16)
        async for output in engine.generate(request):
            streamed += output.outputs[0].new_token_ids
        assert streamed == greedy_reference[2]
        long = EngineRequest("s2", prompts[3], SamplingParams(temperature=0, max_tokens=200))
        async for _ in engine.generate(long):
            break  # a client going away
        for _ in range(100):
            if not llm.engine.requests:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(EngineError, match="vocabulary"):
            async for _ in engine.generate(EngineRequest("s3", [10**9], GREEDY16)):
                pass

    try:
        asyncio.run(main())
        assert_idle(llm)
    finally:
        engine.shutdown()


def test_a_request_id_in_use_is_refused_and_the_first_stream_goes_on(llm, prompts):
    engine = AsyncEngine(engine=llm.engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        first = engine.generate(EngineRequest("dup", prompts[2], params))
        tokens = (await anext(first)).outputs[0].new_token_ids
        with pytest.raises(RequestRejected, match="'dup' is already in use"):
            async for _ in engine.generate(EngineRequest("dup", prompts[3], params)):
                pass

        async def rest():
            async for output in first:
                tokens.extend(output.outputs[0].new_token_ids)

        await asyncio.wait_for(rest(), 30)  # before the fix it waited forever
        assert len(tokens) == 24

    try:
        asyncio.run(main())
        assert_idle(llm)
    finally:
        engine.shutdown()


def test_a_request_the_engine_cannot_add_fails_alone(llm, prompts, greedy_reference):
    """An unexpected error while adding one request (here a malformed handed-over sampler
    state) fails that request; the step loop keeps serving the others."""
    engine = AsyncEngine(engine=llm.engine)
    broken = ImportedPrefill(5, None, generator_state=torch.zeros(3, dtype=torch.uint8))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=4)

    async def main():
        with pytest.raises(EngineError, match="could not add"):
            bad = EngineRequest("bad", prompts[2], seeded, imported=broken)
            async for _ in engine.generate(bad):
                pass
        assert engine.is_running
        streamed = []
        async for output in engine.generate(EngineRequest("good", prompts[2], GREEDY16)):
            streamed += output.outputs[0].new_token_ids
        assert streamed == greedy_reference[2]

    try:
        asyncio.run(main())
        assert_idle(llm)
    finally:
        engine.shutdown()


def test_forked_sequences_survive_preemption_unchanged(tiny, prompts):
    """n-sampling and beam search recompute every fork after preemption, then go on as before."""
    sampled = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=16, ignore_eos=True)
    # 24 blocks hold both requests until their forks' outputs need more: then the newer one
    # (the 150-token prompt's) is preempted mid-output, its forks apart. Once as the samples,
    # once as the beams.
    tight = make_llm("demo-tiny", num_kv_blocks=24)
    for params in ([beams, sampled], [sampled, beams]):
        batch = [prompts[6], prompts[7]]
        roomy, squeezed = tiny.generate(batch, params), tight.generate(batch, params)
        assert squeezed[1].metrics.num_preemptions > 0
        for a, b in zip(roomy, squeezed, strict=True):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert_idle(tight)


def test_forks_the_prefix_cache_restores_whole_go_on_after_preemption(tiny, prompts):
    """Forks preempted while each holds only full blocks before its last token come back from the
    prefix cache complete, nothing left to recompute: the request is scheduled on and finishes as
    it would have unpreempted (it used to wait forever with the pool free)."""
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    prompt = prompts[4]  # 31 tokens: after two steps each fork holds 33, two full blocks + one
    expected = tiny.generate([prompt], params)[0]
    engine = make_llm("demo-tiny").engine
    engine.add_request(EngineRequest("r", prompt, params))
    scheduler = engine.scheduler
    while not scheduler.running or scheduler.running[0].seqs[0].num_tokens < len(prompt) + 2:
        engine.step()
    request = scheduler.running[0]
    assert [s.num_tokens for s in request.seqs] == [33, 33]
    scheduler.running.remove(request)
    scheduler._preempt(request)
    finished = None
    for _ in range(20):
        finished = next((o for o in engine.step() if o.finished), None) or finished
        if not engine.has_unfinished_requests():
            break
    assert finished is not None, "the preempted request was never scheduled again"
    assert [c.token_ids for c in finished.outputs] == [c.token_ids for c in expected.outputs]
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def test_async_engine_under_concurrent_load_with_cancellations(llm, prompts, greedy_reference):
    """Many streams at once, a third cancelled midway: the rest finish exactly, nothing leaks."""
    engine = AsyncEngine(engine=llm.engine)

    async def consume(i: int) -> list[int] | None:
        index = i % len(prompts)
        streamed = []
        request = EngineRequest(f"load-{i}", prompts[index], GREEDY16, priority=1 + i % 5)
        async for output in engine.generate(request):
            streamed += output.outputs[0].new_token_ids
            if i % 3 == 0 and len(streamed) >= 4:
                return None  # the client goes away
        assert streamed == greedy_reference[index]
        return streamed

    async def main():
        results = await asyncio.gather(*(consume(i) for i in range(18)))
        assert sum(r is None for r in results) == 6
        for _ in range(100):
            if not llm.engine.requests:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(main())
        assert_idle(llm)
    finally:
        engine.shutdown()


def test_async_engine_wakes_each_loop_once_per_step_and_batches_for_slow_consumers(
    llm, prompts, greedy_reference
):
    """One hand-over per step for all requests of an event loop; a consumer that fell behind
    gets every queued output at once (in order, nothing lost), one that keeps up gets each
    step's output alone, the first one included."""
    engine = AsyncEngine(engine=llm.engine)

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            calls.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting

        async def consume(i, slow):
            batches = []
            request = EngineRequest(f"b{i}", prompts[i], GREEDY16)
            async for batch in engine.generate_batches(request):
                batches.append([o.outputs[0].new_token_ids for o in batch])
                if slow:
                    await asyncio.sleep(0.15)
            return batches

        fast, slow, *others = await asyncio.gather(
            consume(2, False), consume(3, True), consume(0, False), consume(1, False)
        )
        return fast, slow, others, calls

    try:
        fast, slow, others, calls = asyncio.run(main())
    finally:
        engine.shutdown()
    for batches, i in ((fast, 2), (slow, 3), (others[0], 0), (others[1], 1)):
        assert [t for batch in batches for ids in batch for t in ids] == greedy_reference[i]
    assert len(fast) >= 12  # (a loop delayed past a whole step may see two at once)
    assert len(slow[0]) == 1  # the first token is never held back to wait for company
    assert any(len(batch) > 1 for batch in slow) and len(slow) < len(greedy_reference[3])
    # 4 requests x 16 tokens: one hand-over per step (16 steps or a few more), not per token
    assert len(calls) <= 20 < 4 * 16
    assert_idle(llm)
