"""The step loop in a process of its own (EngineConfig.engine_process): the same tokens as on a
thread, aborts and refusals across the pipe, binding to cores, and failures that end streams
instead of hanging them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal

import pytest

from serve_app.engine import EngineConfig, SamplingParams
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    StepMetrics,
    TokenLogprob,
    pack_step,
    unpack_step,
)
from serve_app.engine.params import FinishReason

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

CONFIG = EngineConfig(
    model="demo-tiny", dtype="float32", max_seq_len=4096, max_input_token_len=128,
    max_iter_times=4000, max_prefill_tokens=256, block_size=16, num_kv_blocks=300,
)  # fmt: skip
# A request that only an abort can end early: its whole length is LONG steps, and an abort test
# asserts that the engine ran a tenth of them at most (its step counter, not a clock)
LONG = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
PROCESS = CONFIG.replace(engine_process=True)
PROMPTS = [[5, 6, 7], list(range(10, 50)), [9] * 17, list(range(100, 103))]
CORE = min(os.sched_getaffinity(0))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def _tokens(engine: AsyncEngine, request_id: str, prompt, params=GREEDY) -> list[int]:
    tokens = []
    async for output in engine.generate(EngineRequest(request_id, list(prompt), params)):
        tokens += output.outputs[0].new_token_ids
    return tokens


async def _all(engine: AsyncEngine, tag: str) -> list[list[int]]:
    runs = [_tokens(engine, f"{tag}{i}", p) for i, p in enumerate(PROMPTS)]
    return list(await asyncio.gather(*runs))


async def _idle(engine: AsyncEngine, steps_before: int | None = None) -> dict:
    """The engine's stats once nothing runs and every block is free (polled for up to 20 s).
    steps_before: the engine's step count when the test's only request started; then fewer
    than a tenth of LONG's steps may have run since (an aborted request, not a finished one)."""
    for _ in range(1000):
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        await asyncio.sleep(0.02)
    stats = engine.stats()
    if steps_before is not None:
        ran = stats["num_steps"] - steps_before
        assert ran < LONG.max_tokens // 10, f"{ran} steps: the request was not aborted early"
    return stats


@pytest.fixture(scope="module")
def process_engine():
    """The module's engine process, bound to one core as engineCpus places it (what
    test_the_engine_process_binds_to_its_cores_and_threads checks): one child for every test
    that needs no fresh one."""
    engine = AsyncEngine(PROCESS.replace(engine_cpus=(CORE,)))
    yield engine
    engine.shutdown()
    assert engine._host._process.poll() is not None  # shutdown ended the child


def test_a_process_engine_gives_the_threads_tokens(process_engine):
    thread_engine = AsyncEngine(CONFIG)
    try:
        expected = asyncio.run(_all(thread_engine, "t"))
    finally:
        thread_engine.shutdown()
    assert process_engine.engine is None  # nothing of the model in this process
    assert process_engine.info.max_model_len == 4096 and process_engine.info.num_blocks == 300
    assert asyncio.run(_all(process_engine, "p")) == expected
    assert process_engine.is_running


def test_leaving_early_aborts_in_the_child_and_frees_its_blocks(process_engine):
    async def run():
        steps = process_engine.stats()["num_steps"]
        async for _ in process_engine.generate(EngineRequest("gone", PROMPTS[1], LONG)):
            break  # the client went away
        return await _idle(process_engine, steps)

    stats = asyncio.run(run())
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_outputs_cross_without_the_prompt_and_get_it_back(process_engine, monkeypatch):
    """Every step's message leaves the prompt ids out (the parent has them) and carries each
    output in its flat form (`serve_app.wire`): streamed outputs as plain values only, which
    pickle writes without calling back into Python; the outputs a stream gets have them again."""
    from serve_app.engine.host import process as engine_process

    read = engine_process.EngineProcess._recv
    crossed = []  # the prompt ids of each output as it came over the socket
    flat = []  # whether it came as plain values all the way down

    def recv(self):
        message = read(self)
        if isinstance(message[0], list):
            for _, packed in message[0]:
                crossed.append(packed[PROMPT_FIELD])
                flat.append(plain(packed))
        return message

    monkeypatch.setattr(engine_process.EngineProcess, "_recv", recv)
    prompt = list(range(1000, 1100))

    async def run():
        outputs = []
        async for output in process_engine.generate(EngineRequest("np", prompt, GREEDY)):
            outputs.append(output)
        return outputs

    outputs = asyncio.run(run())
    assert len(outputs) == 12 and all(o.prompt_token_ids == prompt for o in outputs)
    # (the reader was already waiting in the unpatched call for the first step's message)
    assert len(crossed) >= 11 and all(ids is None for ids in crossed)
    # the final output carries its finish reason (an enum): not plain values only
    assert flat[:-1] == [True] * (len(flat) - 1) and not flat[-1]


PROMPT_FIELD = [f.name for f in dataclasses.fields(RequestOutput)].index("prompt_token_ids")


def plain(value) -> bool:
    """Whether pickle writes value without calling back into Python."""
    if type(value) in (list, tuple):
        return all(plain(v) for v in value)
    return type(value) in (str, int, float, bool, type(None))


def test_a_steps_outputs_pack_flat_and_come_back_equal():
    """pack_step turns every output of a step into its flat form (a streamed one into plain
    values only) and leaves an exception as it is; unpack_step gives back equal outputs
    without the prompt."""

    def output(rid, *choices, **fields):
        return RequestOutput(rid, [1, 2, 3], list(choices), metrics=StepMetrics(32, 1.5), **fields)

    def streamed(index=0, **fields):
        tokens = [7]
        return CompletionOutput(index, tokens, tokens, **fields)

    more = {
        "finished": True, "step_history": [StepMetrics(32, 1.0)], "kv_payload": b"kv",
        "generator_state": b"state", "kv_import_ms": 2.0,
    }  # fmt: skip
    more_choice = {
        "logprobs": [TokenLogprob(7, -0.1, [(8, -2.5)])], "finish_reason": FinishReason.LENGTH,
        "stop_reason": "x", "text": "a",
    }  # fmt: skip
    first = output("a", streamed())
    first.metrics = StepMetrics(4, 12.0, prefill_time_ms=80.0, num_preemptions=1)
    others = [output("o", streamed(), **{name: value}) for name, value in more.items()]
    others += [output("o", streamed(**{name: value})) for name, value in more_choice.items()]
    others += [output("o", streamed(0), streamed(1))]
    others += [output("o", CompletionOutput(0, [5, 7], [7]))]  # all tokens so far
    items = [("a", first), ("b", output("b", streamed(cumulative_logprob=-0.5)))]
    items += [("o", other) for other in others] + [("x", RuntimeError("failed"))]
    packed = pack_step(items)
    assert all(type(out) is tuple for _, out in packed[:-1])
    assert plain(packed[:2]) and packed[-1][1] is items[-1][1]
    back = unpack_step(pickle.loads(pickle.dumps(packed)))
    assert [rid for rid, _ in back] == [rid for rid, _ in items]
    for (_, was), (_, now) in zip(items[:-1], back[:-1], strict=True):
        assert was.prompt_token_ids is None and now == was  # pack_step dropped the prompt
    assert str(back[-1][1]) == "failed"


def test_streamed_outputs_carry_only_their_new_tokens(process_engine):
    """Each step's output before the last holds its new token's id and logprob only, so the
    per-step message does not grow with the output; the final output holds them all."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    async def run():
        request = EngineRequest("delta", list(range(200, 240)), params)
        return [output async for output in process_engine.generate(request)]

    outputs = asyncio.run(run())
    *partial, final = [o.outputs[0] for o in outputs]
    assert len(partial) == 11 and final.finished
    for co in partial:
        assert co.token_ids == co.new_token_ids and len(co.token_ids) == 1
        assert len(co.logprobs) == 1 and co.logprobs[0].token_id == co.token_ids[0]
    streamed = [co.new_token_ids[0] for co in partial] + final.new_token_ids
    assert final.token_ids == streamed and len(final.logprobs) == 12
    assert [lp.token_id for lp in final.logprobs] == streamed


def test_a_refused_request_fails_alone(process_engine):
    async def run():
        bad = _tokens(process_engine, "bad", [10**9])  # outside the vocabulary
        good = _tokens(process_engine, "good", PROMPTS[0])
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, RequestRejected) and "vocabulary" in str(bad)
    assert len(good) == GREEDY.max_tokens


def test_a_dead_engine_process_ends_every_stream_and_refuses_new_ones():
    engine = AsyncEngine(PROCESS)

    async def run():
        stream = engine.generate(EngineRequest("victim", PROMPTS[1], LONG))
        await anext(stream)
        os.kill(engine._host.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process exited"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineError, match="not running"):
            await _tokens(engine, "after", PROMPTS[0])

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        engine.shutdown()


def test_the_engine_process_binds_to_its_cores_and_threads(process_engine):
    # (that its shutdown ends the child is checked as the module's fixture ends it)
    assert process_engine.info.cpus == (CORE,) and process_engine.info.num_threads == 1
    pid = process_engine._host.pid
    assert os.sched_getaffinity(pid) == {CORE}
    with open(f"/proc/{pid}/environ", "rb") as f:  # big buffers reused from the heap
        assert b"MALLOC_MMAP_THRESHOLD_=" in f.read()
    assert len(asyncio.run(_tokens(process_engine, "bound", PROMPTS[0]))) == GREEDY.max_tokens


@pytest.mark.parametrize(
    "config, message",
    [
        (PROCESS.replace(engine_cpus=(4096,)), "cores 4096 are not available here"),
        (PROCESS.replace(engine_spare_cpus=(4097,)), "cores 4097 are not available here"),
        (PROCESS.replace(model="/nonexistent/weights"), "does not exist"),
    ],
)
def test_an_engine_process_that_cannot_start_says_why(config, message):
    with pytest.raises(RuntimeError, match="failed to start") as failure:
        AsyncEngine(config)
    assert message in str(failure.value)


def test_engine_cpus_need_the_process():
    with pytest.raises(ValueError, match="engineCpus needs engineProcess"):
        CONFIG.replace(engine_cpus=(0,))


def test_a_failed_step_ends_the_thread_engine_its_requests_and_refuses_new_ones(caplog):
    """A step that raises leaves an engine whose state cannot be trusted: its requests fail
    with a message free of internals (the details are logged), the loop ends so that the health
    check replaces the replica, and a new request fails at once instead of waiting forever."""
    engine = AsyncEngine(CONFIG)
    steps = 0
    real_step = engine.engine.step

    def failing_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("index out of range in /opt/secret/kernel.py")
        return real_step()

    engine.engine.step = failing_step

    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        runs = [_tokens(engine, f"r{i}", PROMPTS[i], params) for i in range(2)]
        return await asyncio.gather(*runs, return_exceptions=True)

    try:
        with caplog.at_level("ERROR"):
            results = asyncio.run(asyncio.wait_for(run(), timeout=60))
        for result in results:
            assert isinstance(result, EngineError) and "engine step failed" in str(result)
            assert "secret" not in str(result)
        assert any("/opt/secret/kernel.py" in r.exc_text for r in caplog.records if r.exc_text)
        engine._host._thread.join(timeout=10)  # the loop ends once it has delivered the failures
        assert not engine.is_running
        with pytest.raises(EngineError, match="not running"):
            asyncio.run(asyncio.wait_for(_tokens(engine, "after", PROMPTS[0]), timeout=10))
        stats = engine.stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        engine.shutdown()


def test_feeding_hands_each_output_to_a_function_and_leaving_aborts(process_engine):
    """AsyncEngine.feeding: the outputs in step order to a plain function (the same tokens as
    generate), a refusal as the exception, and leaving the block early aborts the request."""

    async def run():
        loop = asyncio.get_running_loop()
        got, done = [], loop.create_future()

        def take(item):
            got.append(item)
            if isinstance(item, Exception) or item.finished:
                done.set_result(None)

        with process_engine.feeding(EngineRequest("fed", PROMPTS[1], GREEDY), take):
            await done
        refused, over = [], loop.create_future()

        def refuse(item):
            refused.append(item)
            over.set_result(None)

        with process_engine.feeding(EngineRequest("oov", [10**9], GREEDY), refuse):
            await over  # outside the vocabulary
        first = loop.create_future()
        steps = process_engine.stats()["num_steps"]
        with process_engine.feeding(
            EngineRequest("left", PROMPTS[1], LONG), lambda x: first.done() or first.set_result(x)
        ):
            await first  # the consumer leaves after the first output
        return got, refused, await _idle(process_engine, steps)

    got, refused, stats = asyncio.run(run())
    expected = asyncio.run(_tokens(process_engine, "fed-again", PROMPTS[1]))
    assert [t for o in got for t in o.outputs[0].new_token_ids] == expected
    assert got[-1].finished and not any(o.finished for o in got[:-1])
    assert len(refused) == 1 and isinstance(refused[0], RequestRejected)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_consumer_that_raises_does_not_starve_the_others(process_engine, caplog):
    """The step's outputs go to every request's consumer in one hand-over: one that raises is
    logged, and the others still get theirs."""

    async def run():
        loop = asyncio.get_running_loop()
        got, done = [], loop.create_future()

        def take(item):
            got.append(item)
            if item.finished:
                done.set_result(None)

        def broken(item):
            raise RuntimeError("a bug in a consumer")

        with process_engine.feeding(EngineRequest("broken", PROMPTS[0], GREEDY), broken):
            with process_engine.feeding(EngineRequest("fine", PROMPTS[1], GREEDY), take):
                await asyncio.wait_for(done, 30)
        return got, await _idle(process_engine)

    got, stats = asyncio.run(run())
    assert sum(len(o.outputs[0].new_token_ids) for o in got) == GREEDY.max_tokens
    assert "a bug in a consumer" in caplog.text
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_the_child_ends_sequences_at_the_tokenizers_eos_it_never_loads(tmp_path):
    """The engine process loads no tokenizer (its parent loads it meanwhile and hands over its
    end-of-sequence id): a model whose config names no end-of-sequence id still stops at the
    tokenizer's, in the child as on a thread."""
    import json

    from serve_app.models.demo import ensure_demo_model

    demo_path = ensure_demo_model("demo-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(demo_path / name)
    config = json.loads((demo_path / "config.json").read_text())
    config.pop("eos_token_id", None)
    (tmp_path / "config.json").write_text(json.dumps(config))  # and no generation_config.json
    eos = json.loads((demo_path / "tokenizer_config.json").read_text())["eos_token"]
    tiny = CONFIG.replace(model=str(tmp_path), num_kv_blocks=16)
    thread = AsyncEngine(tiny)
    process = AsyncEngine(tiny.replace(engine_process=True))
    try:
        expected = thread.tokenizer.convert_tokens_to_ids(eos)
        assert process.tokenizer.convert_tokens_to_ids(eos) == expected
        assert thread.info.eos_token_ids == process.info.eos_token_ids == (expected,)
        assert process._host.pid != os.getpid() and thread.engine is not None
    finally:
        process.shutdown()
        thread.shutdown()
