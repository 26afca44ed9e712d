"""ModelReplica without Ray: text deltas, stop strings at the exact step, errors as chunks."""

import asyncio
import contextlib
import time
import uuid

import pytest

from serve_app.config import load_config
from serve_app.engine.params import SamplingParams
from serve_app.messages import ReplicaRequest
from serve_app.replica.model_replica import ModelReplica
from tests.stepping import Stepping

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

CONFIG = {
    "BackendConfig": {
        "ModelDeployConfig": {
            "maxSeqLen": 512,
            "maxInputTokenLen": 256,
            "ModelConfig": [
                {"modelName": "demo", "modelWeightPath": "demo-tiny", "dtype": "float32"}
            ],
        },
        "ScheduleConfig": {
            "maxIterTimes": 480,
            "maxPrefillTokens": 256,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 128,
        },
    }
}
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. 你好，世界"
# More tokens than any machine generates before a 0.05 s timeout or an abort lands
LONG = 480


@pytest.fixture(scope="module")
def replica():
    replica = ModelReplica(load_config(CONFIG))
    yield replica
    replica.shutdown()


@pytest.fixture(scope="module")
def prompt(replica):
    return replica.tokenizer.encode(PROMPT_TEXT)


def greedy(max_tokens=32, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def request(prompt, params, **kw):
    return ReplicaRequest(f"req-{uuid.uuid4().hex[:8]}", list(prompt), params, **kw)


def collect(replica, req):
    async def run():
        return [chunk async for chunk in replica.generate(req)]

    return asyncio.run(run())


def joined(chunks, index=0, attr="text"):
    """One choice's field over all chunks: text joined, lists concatenated."""
    parts = [getattr(c, attr) for ch in chunks for c in ch.choices if c.index == index]
    return "".join(parts) if attr == "text" else [x for part in parts for x in part]


def last_delta(chunks, index=0):
    return [c for ch in chunks for c in ch.choices if c.index == index][-1]


def wait_idle(replica, timeout=2.0):
    """Engine stats once no request runs and every KV block is free (abort lands async)."""
    stats, end = None, time.monotonic() + timeout
    while time.monotonic() < end:
        stats = replica.engine.stats()
        if (
            stats["num_running"] == stats["num_waiting"] == 0
            and stats["num_free_blocks"] == stats["num_blocks"]
        ):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {stats}")


@pytest.fixture(scope="module")
def reference(replica, prompt):
    """A greedy run of 32 tokens with per-token texts: the ground truth for the stop tests."""
    chunks = collect(replica, request(prompt, greedy(), token_texts=True, stream=False))
    (choice,) = chunks[0].choices
    assert len(choice.token_ids) == 32 and choice.finish_reason == "length"
    return choice


def test_stream_equals_non_stream_and_decode(replica, prompt, reference):
    req = request(prompt, greedy(), token_texts=True)
    chunks = collect(replica, req)
    assert len(chunks) > 1 and all(ch.request_id == req.request_id for ch in chunks)
    assert all(ch.choices for ch in chunks)  # no empty chunks
    assert [ch.finished for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    ids = joined(chunks, attr="token_ids")
    assert ids == reference.token_ids
    assert joined(chunks) == reference.text == replica.tokenizer.decode(ids)
    final = chunks[-1]
    assert final.num_prompt_tokens == len(prompt) and final.replica_id == replica.replica_id
    assert final.stats["replica_id"] == replica.replica_id  # (kept apart per replica in /metrics)
    assert final.stats["num_blocks"] == 128 and final.error is None
    assert last_delta(chunks).finish_reason == "length"
    assert last_delta(chunks).num_output_tokens == 32
    assert sum(len(ch.steps) for ch in chunks) == 32
    assert chunks[0].steps[0].prefill_time_ms is not None
    assert chunks[-1].steps[0].decode_time_ms is not None


def test_token_texts_one_per_token(replica, prompt, reference):
    assert len(reference.token_texts) == len(reference.token_ids)
    assert "".join(reference.token_texts) == reference.text
    chunks = collect(replica, request(prompt, greedy(), token_texts=True))
    for ch in chunks:
        for c in ch.choices:
            assert len(c.token_texts) == len(c.token_ids)
    assert joined(chunks, attr="token_texts") == reference.token_texts
    plain = collect(replica, request(prompt, greedy(4)))
    assert all(c.token_texts is None and c.logprobs is None for c in plain[-1].choices)


def spanning_stop(reference):
    """A stop string made of the end of one token and the start of the next."""
    texts, full = reference.token_texts, reference.text
    for k in range(3, len(texts) - 1):
        a, b = texts[k], texts[k + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            start = len("".join(texts[: k + 1])) - 2
            if full.find(stop) == start:
                return stop, start, k + 2  # tokens up to and including the completing one
    pytest.skip("no token boundary with two-character tokens on both sides")


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(replica, prompt, reference, stream, include, monkeypatch):
    stop, start, num_tokens = spanning_stop(reference)
    stepping, sent, abort = Stepping(replica.engine.engine, monkeypatch), [], replica.engine.abort
    # the steps run when the replica, having matched the stop string, sends the abort
    monkeypatch.setattr(
        replica.engine, "abort", lambda rid: sent.append(stepping.steps) or abort(rid)
    )
    req = request(
        prompt,
        greedy(64),
        stop=["never-there", stop],
        include_stop_str_in_output=include,
        stream=stream,
        token_texts=True,
    )
    chunks = collect(replica, req)
    end = start + len(stop) if include else start
    assert joined(chunks) == reference.text[:end]
    # nothing past the stop string, in any chunk, in any field
    assert "".join(joined(chunks, attr="token_texts")) == reference.text[: start + len(stop)]
    assert joined(chunks, attr="token_ids") == reference.token_ids[:num_tokens]
    last = last_delta(chunks)
    assert (last.finish_reason, last.stop_reason) == ("stop_string", stop)
    assert last.num_output_tokens == num_tokens and chunks[-1].finished
    wait_idle(replica)  # the engine request ended at that step (aborted, blocks freed)
    # aborted as the stop string was matched, before the 64 tokens ran out; the engine then ran
    # at most the step under way and one it started before reading the abort. (The steps
    # between the completing token and the match are the event loop's lag behind the step
    # loop: one on a quiet machine, more on a loaded one.)
    assert len(sent) == 1 and num_tokens <= sent[0] < 64
    assert stepping.steps <= sent[0] + 2


def test_stop_string_in_first_token(replica, prompt, reference):
    stop = reference.token_texts[0][:2]
    chunks = collect(replica, request(prompt, greedy(64), stop=[stop]))
    assert joined(chunks) == reference.text[: reference.text.find(stop)]
    assert last_delta(chunks).num_output_tokens == 1
    wait_idle(replica)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(replica, prompt, reference, include):
    ids = reference.token_ids
    k = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    params = greedy(64, stop_token_ids=[ids[k]])
    chunks = collect(replica, request(prompt, params, include_stop_str_in_output=include))
    assert joined(chunks, attr="token_ids") == ids[: k + 1]
    decode = replica.tokenizer.decode
    assert joined(chunks) == decode(ids[: k + 1] if include else ids[:k])
    last = last_delta(chunks)
    stop_text = decode([ids[k]], skip_special_tokens=False)  # the token's text, never its id
    assert (last.finish_reason, last.stop_reason) == ("stop_token", stop_text)
    assert last.num_output_tokens == k + 1


@pytest.mark.parametrize("stream", [True, False])
def test_n2_stop_string_ends_one_choice(replica, prompt, stream):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    base = collect(replica, request(prompt, params, token_texts=True, stream=False))[0].choices
    assert [c.index for c in base] == [0, 1] and base[0].text != base[1].text
    stop = next(
        t
        for t in base[0].token_texts[4:]
        if len(t) >= 3 and t not in base[1].text and base[0].text.count(t) == 1
    )
    chunks = collect(replica, request(prompt, params, stop=[stop], stream=stream))
    first, second = last_delta(chunks, 0), last_delta(chunks, 1)
    assert joined(chunks, 0) == base[0].text[: base[0].text.find(stop)]
    assert (first.finish_reason, first.stop_reason) == ("stop_string", stop)
    assert joined(chunks, 1) == base[1].text and second.finish_reason == "length"
    assert second.num_output_tokens == 24 and chunks[-1].finished
    wait_idle(replica)


@pytest.mark.parametrize("texts", [True, False])
def test_logprobs(replica, prompt, reference, texts):
    req = request(prompt, greedy(8, logprobs=3), logprob_texts=texts, stream=False)
    (choice,) = collect(replica, req)[0].choices
    assert len(choice.logprobs) == len(choice.token_ids) == 8
    decode = replica.tokenizer.decode
    for token_id, lp in zip(choice.token_ids, choice.logprobs, strict=True):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token_id  # greedy: the best one
        assert lp.token == (decode([token_id]) if texts else "")
        assert [t for _, t, _ in lp.top] == (
            [decode([i]) for i, _, _ in lp.top] if texts else [""] * 3
        )
    assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in choice.logprobs))
    streamed = collect(replica, request(prompt, greedy(8, logprobs=0)))
    assert [len(c.logprobs) for ch in streamed for c in ch.choices] == [
        len(c.token_ids) for ch in streamed for c in ch.choices
    ]


def test_timeout_before_first_token(replica, prompt):
    chunks = collect(replica, request(prompt, greedy(64), timeout_s=0.0))
    final = chunks[-1]
    assert final.finished and final.error_kind == "timeout" and "timed out" in final.error
    assert last_delta(chunks).finish_reason == "timeout"
    wait_idle(replica)


def test_timeout_mid_stream(replica, prompt, monkeypatch):
    # each step at least 1 ms: LONG tokens take longer than the timeout on any machine
    Stepping(replica.engine.engine, monkeypatch, pace_s=0.001)
    chunks = collect(replica, request(prompt, greedy(LONG), timeout_s=0.05, token_texts=True))
    assert chunks[-1].error_kind == "timeout" and len(joined(chunks, attr="token_ids")) < LONG
    ids = joined(chunks, attr="token_ids")
    assert joined(chunks) == replica.tokenizer.decode(ids)
    assert len(joined(chunks, attr="token_texts")) == len(ids)
    wait_idle(replica)


@pytest.mark.parametrize(
    "prompt_ids",
    [[1, 2, 200_000], list(range(100, 700))],  # out of vocabulary; longer than maxSeqLen
    ids=["bad_id", "too_long"],
)
def test_rejected(replica, prompt_ids):
    chunks = collect(replica, request(prompt_ids, greedy(8)))
    assert len(chunks) == 1
    final = chunks[0]
    assert final.finished and final.error_kind == "rejected" and final.error
    assert final.choices == [] and final.replica_id == replica.replica_id
    assert final.num_prompt_tokens == len(prompt_ids)


def test_closing_the_stream_aborts(replica, prompt):
    async def run():
        stream = replica.generate(request(prompt, greedy(64)))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(run())
    assert not first.finished and first.choices[0].token_ids
    wait_idle(replica)


def test_abort_method_ends_with_aborted(replica, prompt):
    req = request(prompt, greedy(LONG))

    async def run():
        chunks = []
        async for chunk in replica.generate(req):
            if not chunks:
                await replica.abort(req.request_id)
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finished and last_delta(chunks).finish_reason == "aborted"
    assert len(joined(chunks, attr="token_ids")) < LONG
    wait_idle(replica)


def test_stats_health_device_info(replica):
    stats = asyncio.run(replica.stats())
    assert stats["replica_id"] == replica.replica_id and stats["model"] == "demo"
    assert stats["role"] == "colocated"  # (the PD roles': tests/replica/test_pd_roles.py)
    assert {"num_running", "num_free_blocks", "num_blocks"} <= stats.keys()
    asyncio.run(replica.check_health())
    info = asyncio.run(replica.device_info())
    assert info["device"] == "cpu" and info["replica_id"] == replica.replica_id
    assert {"ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} <= info.keys()


def test_shutdown_fails_health_check():
    other = ModelReplica(load_config(CONFIG))
    asyncio.run(other.check_health())
    other.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(other.check_health())
    other.shutdown()  # idempotent


class _HungRank:
    """The ranks of a split model whose rank 1 does not answer (over Ray: test_world_size.py)."""

    def failure(self) -> None:
        return None

    async def unanswered(self) -> str:
        return "rank 1 of worldSize 2 has not answered in 10 s: it hangs"

    def close(self) -> None:
        pass


def test_a_hung_rank_ends_the_open_requests_refuses_new_ones_and_fails_health(prompt):
    """A rank that hangs fails no collective: rank 0's step waits in the next one. The health
    check finds it, ends every open request with why (they would wait forever), refuses new
    ones the same way and fails, so Ray Serve replaces the replica with its ranks."""
    import threading

    other = ModelReplica(load_config(CONFIG))
    release, entered = threading.Event(), threading.Event()
    step = other.engine.engine.step

    def waiting_step():  # as rank 0 waits for the hung rank in a collective
        entered.set()
        release.wait(30)
        return step()

    other.engine.engine.step = waiting_step
    done = []
    runner = threading.Thread(
        target=lambda: done.append(collect(other, request(prompt, greedy(4))))
    )
    try:
        asyncio.run(other.check_health())  # no ranks: healthy
        other.ranks = _HungRank()
        runner.start()
        assert entered.wait(10)
        with pytest.raises(RuntimeError, match="rank 1 of worldSize 2 .* it hangs"):
            asyncio.run(other.check_health())
        runner.join(10)
        assert done and done[0][-1].finished and "it hangs" in done[0][-1].error
        refused = collect(other, request(prompt, greedy(4)))
        assert refused[-1].finished and "it hangs" in refused[-1].error
        with pytest.raises(RuntimeError, match="it hangs"):  # and stays unhealthy
            asyncio.run(other.check_health())
    finally:
        release.set()
        other.shutdown()


def test_a_hung_step_fails_the_health_check_within_token_timeout(prompt, monkeypatch):
    """A step that never returns leaves the loop alive: the health check sees no output for
    tokenTimeout while a request waits and fails, so Ray Serve replaces the replica. Idle, or
    stepping, it passes."""
    import copy
    import threading

    config = copy.deepcopy(CONFIG)
    config["ServerConfig"] = {"tokenTimeout": 1}
    other = ModelReplica(load_config(config))
    release, entered = threading.Event(), threading.Event()
    step = other.engine.engine.step

    def hung_step():
        entered.set()
        release.wait(30)
        return step()

    try:
        time.sleep(1.2)
        asyncio.run(other.check_health())  # idle for longer than tokenTimeout: healthy
        monkeypatch.setattr(other.engine.engine, "step", hung_step)
        done = []
        runner = threading.Thread(
            target=lambda: done.append(collect(other, request(prompt, greedy(4))))
        )
        runner.start()
        assert entered.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and other.engine.stalled_s() <= 1:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="no output for .* a step hangs"):
            asyncio.run(other.check_health())
        release.set()
        runner.join(30)
        # the request, past its own tokenTimeout by then, ends with that error; nothing leaks
        assert done and done[0][-1].finished and "timeout" in (done[0][-1].error or "").lower()
        wait_idle(other)
        asyncio.run(other.check_health())
    finally:
        release.set()
        other.shutdown()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "params",
    [
        greedy(7, n=2, use_beam_search=True, logprobs=2),
        SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True),
    ],
    ids=["beam", "best_of"],
)
def test_engine_non_streaming_requests_report_one_step_per_token(replica, prompt, params, stream):
    chunks = collect(replica, request(prompt, params, stream=stream))
    assert chunks[-1].finished
    steps = [s for ch in chunks for s in ch.steps]
    longest = max(len(joined(chunks, i, "token_ids")) for i in range(params.n))
    assert longest == 7 and len(steps) == 7
    assert steps[0].prefill_time_ms is not None and steps[0].decode_time_ms is None
    assert all(s.decode_time_ms is not None and s.prefill_time_ms is None for s in steps[1:])
    if params.logprobs is not None:
        for i in range(params.n):
            lps = joined(chunks, i, "logprobs")
            assert len(lps) == len(joined(chunks, i, "token_ids"))
            assert all(len(lp.top) == 2 and lp.top[0][2] >= lp.top[1][2] for lp in lps)
    wait_idle(replica)


def test_a_consumer_behind_the_engine_gets_coalesced_chunks_with_nothing_lost(
    replica, prompt, reference, monkeypatch
):
    """Chunks the engine produced while the consumer was busy go out as one chunk: the same
    token ids, texts, token texts and step timings as one chunk per token, fewer messages."""
    req = request(prompt, greedy(), token_texts=True)
    # Counted, not timed: the engine's second step waits until the consumer has the first
    # chunk, and after each chunk the consumer waits until the engine is three steps ahead
    stepping = Stepping(replica.engine.engine, monkeypatch)
    took_first = stepping.hold_before(2)

    async def slow():
        chunks, received = [], 0
        async for chunk in replica.generate(req):
            chunks.append(chunk)
            took_first.set()
            received += len(chunk.choices[0].token_ids) if chunk.choices else 0
            await asyncio.to_thread(stepping.wait_for, min(received + 3, 32))
        return chunks

    chunks = asyncio.run(slow())
    assert len(chunks) < 32 and any(len(ch.choices[0].token_ids) > 1 for ch in chunks)
    assert len(chunks[0].choices[0].token_ids) == 1  # the first token goes out at once
    assert joined(chunks, attr="token_ids") == reference.token_ids
    assert joined(chunks) == reference.text
    assert joined(chunks, attr="token_texts") == reference.token_texts
    assert sum(len(ch.steps) for ch in chunks) == 32
    assert [ch.finished for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    assert last_delta(chunks).finish_reason == "length"
    assert last_delta(chunks).num_output_tokens == 32
    wait_idle(replica)


def test_a_replica_whose_engine_is_bound_keeps_to_the_other_cores():
    import copy
    import os

    from serve_app.placement import bind_process

    here = sorted(os.sched_getaffinity(0))
    if len(here) < 2:
        pytest.skip("needs two cores: one for the engine, one for the serving path")
    config = copy.deepcopy(CONFIG)
    model = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model.update(engineProcess=True, engineCpus=str(here[-1]))
    replica = ModelReplica(load_config(config), off_engine_cores=True)
    try:
        assert os.sched_getaffinity(0) == set(here[:-1])  # the replica: the serving path's
        assert os.sched_getaffinity(replica.engine._host.pid) == {here[-1]}
    finally:
        replica.shutdown()
        bind_process(here)


class LocalResponse:
    """The replica's generate() as a Serve streaming response: iterable, with cancel()."""

    def __init__(self, stream) -> None:
        self.stream, self.yielded = stream, []

    async def _items(self):
        async for chunk in self.stream:
            self.yielded.append(chunk)
            yield chunk

    def __aiter__(self):
        return self._items()

    def cancel(self) -> None:
        asyncio.ensure_future(self.stream.aclose())


def through_token_socket(replica, req, node="node-a", leave_after=None):
    """req through an ingress token inbox on `node` (the replica on node-a): the chunks the
    inbox's stream gives, what the replica yielded through its own stream, and the inbox."""
    from serve_app.token_socket.inbox import TokenInbox
    from serve_app.token_socket.outbox import TokenOutbox

    async def run():
        inbox, response = TokenInbox(node), None
        replica.outbox = TokenOutbox("node-a")

        def send():
            nonlocal response
            response = LocalResponse(replica.generate(req))
            return response

        chunks = []
        try:
            async with contextlib.aclosing(inbox.stream(req, send)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if leave_after is not None and len(chunks) == leave_after:
                        break
            await asyncio.sleep(0.05)  # the replica's cancellation lands
        finally:
            inbox.close()
            replica.outbox.close()
        return chunks, response.yielded, inbox

    return asyncio.run(run())


def test_chunks_through_the_ingress_token_socket_are_the_streams_own(replica, prompt, reference):
    req = request(prompt, greedy(), token_texts=True)
    chunks, yielded, inbox = through_token_socket(replica, req)
    assert yielded == []  # nothing went through the replica's own (Ray) stream
    # every chunk came through the socket; a consumer that falls behind gets the chunks waiting
    # for it folded into one (TokenInbox.stream), so the socket may have carried more than it
    # yielded, never fewer
    assert inbox.num_chunks >= len(chunks) > 1
    assert joined(chunks, attr="token_ids") == reference.token_ids
    assert joined(chunks) == reference.text
    final = chunks[-1]
    assert final.finished and final.error is None and final.stats["num_blocks"] == 128
    assert final.replica_id == replica.replica_id and final.num_prompt_tokens == len(prompt)
    assert sum(len(ch.steps) for ch in chunks) == 32
    wait_idle(replica)


def test_an_ingress_on_another_node_gets_the_chunks_through_the_replicas_stream(
    replica, prompt, reference
):
    req = request(prompt, greedy())
    chunks, yielded, inbox = through_token_socket(replica, req, node="node-b")
    assert yielded == chunks and inbox.num_frames == 0
    assert joined(chunks, attr="token_ids") == reference.token_ids and chunks[-1].finished


def test_leaving_a_socket_stream_early_aborts_and_frees_the_blocks(replica, prompt):
    req = request(prompt, greedy(LONG))
    chunks, yielded, _ = through_token_socket(replica, req, leave_after=1)
    assert len(chunks) == 1 and not chunks[0].finished and yielded == []
    wait_idle(replica)


def test_a_token_socket_closed_mid_request_ends_it_and_frees_the_blocks(replica, prompt):
    """The ingress's side closes while the replica still streams to it (what Ray would carry
    on): the replica ends the request with an error through its own stream."""
    from serve_app.token_socket.inbox import TokenInbox
    from serve_app.token_socket.outbox import TokenOutbox

    req = request(prompt, greedy(LONG))

    async def run():
        inbox = TokenInbox("node-a")
        replica.outbox = TokenOutbox("node-a")
        req.reply_to = await inbox.address()
        task = asyncio.ensure_future(collect_async(replica.generate(req)))
        while inbox.num_chunks == 0:
            await asyncio.sleep(0.01)
        inbox.close()  # the ingress's side of every connection closes
        yielded = await asyncio.wait_for(task, 10)
        replica.outbox.close()
        return yielded

    yielded = asyncio.run(run())
    assert len(yielded) == 1 and yielded[0].finished and yielded[0].error_kind == "engine"
    assert "token socket" in yielded[0].error
    wait_idle(replica)


async def collect_async(stream):
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("sink", ["socket", "ray"])
def test_a_stream_is_made_in_the_steps_hand_over_not_by_its_coroutine(
    replica, prompt, reference, monkeypatch, sink
):
    """Through the token socket and through Ray alike (one sink interface, replica/relay.py)
    the chunks are made as the engine hands each output over (AsyncEngine.feeding): the
    request's coroutine does not iterate the engine's outputs."""

    def no_batches(request):
        raise AssertionError("a stream iterated generate_batches")

    monkeypatch.setattr(replica.engine, "generate_batches", no_batches)
    if sink == "socket":
        chunks, yielded, _ = through_token_socket(replica, request(prompt, greedy()))
        assert yielded == []
    else:
        chunks = collect(replica, request(prompt, greedy()))
    assert joined(chunks, attr="token_ids") == reference.token_ids
    wait_idle(replica)


@pytest.mark.parametrize("n", [1, 2])
def test_a_stop_string_ends_a_socket_stream_there_and_frees_the_blocks(
    replica, prompt, reference, n
):
    """Every choice ended by stop strings while the engine still runs the request: the final
    chunk goes through the socket, later outputs are dropped, the engine request is aborted."""
    stop = next(t for t in reference.token_texts[6:] if len(t) >= 2)
    cut = reference.text[: reference.text.find(stop)]
    params = greedy(LONG, n=n) if n == 1 else SamplingParams(
        n=2, temperature=0, max_tokens=LONG, ignore_eos=True
    )  # fmt: skip
    chunks, yielded, _ = through_token_socket(replica, request(prompt, params, stop=[stop]))
    assert yielded == [] and chunks[-1].finished and chunks[-1].error is None
    for index in range(n):
        assert joined(chunks, index) == cut
        assert (last_delta(chunks, index).finish_reason, last_delta(chunks, index).stop_reason) == (
            "stop_string",
            stop,
        )
    wait_idle(replica)


@pytest.mark.parametrize("path", ["ray", "socket"])
def test_stream_interval_sends_that_many_tokens_a_chunk_with_nothing_lost(
    replica, prompt, reference, path, monkeypatch
):
    """stream_interval 5: the first token at once, then chunks of 5 tokens, the rest last;
    the same ids, text, token texts and step timings as a chunk per token."""
    # A consumer that falls behind the engine gets consecutive steps' tokens in one chunk (by
    # design: the sink folds them), which on a loaded machine merged the first chunk with the next
    # five. Steps 20 ms apart keep the consumer ahead, so the chunk sizes are the interval's.
    Stepping(replica.engine.engine, monkeypatch, pace_s=0.02)
    req = request(prompt, greedy(), token_texts=True, stream_interval=5)
    chunks = collect(replica, req) if path == "ray" else through_token_socket(replica, req)[0]
    assert [len(ch.choices[0].token_ids) for ch in chunks] == [1, 5, 5, 5, 5, 5, 5, 1]
    assert joined(chunks, attr="token_ids") == reference.token_ids
    assert joined(chunks) == reference.text
    assert joined(chunks, attr="token_texts") == reference.token_texts
    assert sum(len(ch.steps) for ch in chunks) == 32
    assert [ch.finished for ch in chunks] == [False] * 7 + [True]
    wait_idle(replica)


@pytest.mark.parametrize("path", ["ray", "socket"])
def test_tokens_held_by_stream_interval_come_before_an_engine_failure(
    replica, prompt, path, monkeypatch
):
    """The engine fails mid-request while chunks are held back: the held tokens go out as a
    chunk of their own, then the error chunk (never folded into it, where a stream would lose
    them)."""
    from serve_app.replica.output_processor import OutputProcessor

    req = request(prompt, greedy(LONG), stream_interval=10_000)
    outputs, process = 0, OutputProcessor.process
    # the second step waits until the first token's output was made a chunk: the first chunk
    # is that token alone however far a fast engine could have run ahead of the consumer
    first_processed = Stepping(replica.engine.engine, monkeypatch).hold_before(2)

    def counted(self, output):
        nonlocal outputs
        outputs += self.req.request_id == req.request_id
        chunk = process(self, output)
        if outputs >= 1:
            first_processed.set()
        return chunk

    monkeypatch.setattr(OutputProcessor, "process", counted)

    async def fail_after_some_steps():
        end = time.monotonic() + 30
        while outputs < 8 and time.monotonic() < end:
            await asyncio.sleep(0.01)
        replica.engine._fail_all("the engine process died (test)")

    async def run():
        failing = asyncio.ensure_future(fail_after_some_steps())
        if path == "ray":
            chunks = await collect_async(replica.generate(req))
        else:
            chunks = await asyncio.to_thread(lambda: through_token_socket(replica, req)[0])
        await failing
        return chunks

    first, held, error = asyncio.run(run())
    assert len(first.choices[0].token_ids) == 1 and not first.finished
    assert len(held.choices[0].token_ids) >= 7 and held.error is None and not held.finished
    assert error.finished and error.error_kind == "engine" and not error.choices
    replica.engine.abort(req.request_id)  # the engine itself never failed: end its request
    wait_idle(replica, timeout=10)


def test_the_replica_records_its_engine_figures_and_reports_what_it_was_sent(
    replica, prompt, monkeypatch
):
    """Its engine's stats carry every figure its Ray metrics record (a missing key would
    record 0 forever), its metrics are told of each output of a request (its timing and
    tokens), and its routing stats name the blocks of the prompts it was sent."""
    from serve_app.replica.replica_metrics import COUNTERS, GAUGES
    from serve_app.routing.prefix_index import ROUTING_STATS_KEY, block_hashes

    stats = replica.engine.stats()
    assert {key for _, key, _ in GAUGES + COUNTERS} <= set(stats)
    replica.metrics.record()
    noted = []
    monkeypatch.setattr(replica.metrics, "note", noted.append)
    collect(replica, request(prompt * 4, greedy(2)))
    assert sum(len(o.outputs[0].new_token_ids) for o in noted) == 2
    assert noted[0].metrics.prefill_time_ms is not None
    assert noted[-1].metrics.decode_time_ms is not None
    reported = replica.record_routing_stats()[ROUTING_STATS_KEY]
    assert set(block_hashes(prompt * 4, 16)) <= set(reported)
