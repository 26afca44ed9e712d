"""ModelReplica in the prefill and decode roles, without Ray: the in-process connector hands the
KV over; the joined output must equal a colocated replica's, and every way out frees the blocks
on both sides."""

import asyncio
import dataclasses
import time
import uuid

import pytest

from serve_app.config import load_config
from serve_app.disagg.connector import LocalConnector
from serve_app.engine.outputs import CompletionOutput, RequestOutput
from serve_app.engine.params import FinishReason, SamplingParams
from serve_app.messages import DecodeRequest, ReplicaRequest
from serve_app.replica.model_replica import ModelReplica
from serve_app.replica.output_processor import OutputProcessor

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

MAX_ITER = 24
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
            "maxIterTimes": MAX_ITER,
            "maxPrefillTokens": 256,
            "cacheBlockSize": 16,
            "kvCacheBlocks": 64,
        },
    }
}
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. 你好，世界"
SEEDED = dict(temperature=1.0, top_k=50, seed=7, repetition_penalty=1.2, presence_penalty=0.4)
SPLIT_CHAR = "龘"  # two tokens in the Qwen2 vocabulary, the first one half a character


@pytest.fixture(scope="module")
def prefill():
    replica = ModelReplica(load_config(CONFIG), role="prefill", connector="local")
    yield replica
    replica.shutdown()


@pytest.fixture(scope="module")
def decode():
    replica = ModelReplica(load_config(CONFIG), role="decode", connector="local")
    yield replica
    replica.shutdown()


@pytest.fixture(scope="module")
def prompt(prefill):
    return prefill.tokenizer.encode(PROMPT_TEXT)


def params(max_tokens=12, **kw):
    kw = {"temperature": 0, **kw}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def request(prompt, sampling, **kw):
    return ReplicaRequest(f"req-{uuid.uuid4().hex[:8]}", list(prompt), sampling, **kw)


def collect(replica, req):
    async def run():
        return [chunk async for chunk in replica.generate(req)]

    return asyncio.run(run())


def run_pd(prefill, decode, req, **decode_kw):
    async def run():
        result = await prefill.prefill(req)
        if result.transfer is None:
            return result, []
        first = result.chunk.choices[0].token_ids[0]
        d = DecodeRequest(
            req, first, result.transfer, result.generator_state, result.first_text_held
        )
        d = dataclasses.replace(d, **decode_kw)
        return result, [chunk async for chunk in decode.decode(d)]

    return asyncio.run(run())


def joined(chunks, attr="text"):
    parts = [getattr(c, attr) for ch in chunks for c in ch.choices]
    return "".join(parts) if attr == "text" else [x for part in parts for x in part]


def wait_idle(*replicas, timeout=3.0):
    for replica in replicas:
        end = time.monotonic() + timeout
        while True:
            s = replica.engine.stats()
            if (
                s["num_running"] == s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_blocks"]
            ):
                break
            assert time.monotonic() < end, f"{replica.role} replica still busy: {s}"
            time.sleep(0.01)


def assert_pd_equals_colocated(prefill, decode, req):
    # What a colocated replica streams: `generate`, which a replica of any role runs the same
    # way (a role only adds `prefill` or `decode`, and names itself in the stats); here the
    # prefill replica's
    expected = collect(prefill, dataclasses.replace(req, request_id="colocated"))
    result, chunks = run_pd(prefill, decode, req)
    first = result.chunk
    assert not first.finished and first.error is None and result.transfer is not None
    assert first.choices[0].finish_reason is None and len(first.choices[0].token_ids) == 1
    pd = [first, *chunks]
    assert joined(pd, "token_ids") == joined(expected, "token_ids")
    assert joined(pd) == joined(expected)
    assert pd[-1].choices[-1].finish_reason == expected[-1].choices[-1].finish_reason
    assert pd[-1].choices[-1].num_output_tokens == expected[-1].choices[-1].num_output_tokens
    assert chunks[-1].finished and chunks[-1].num_prompt_tokens == len(req.prompt_token_ids)
    wait_idle(prefill, decode)
    return result, chunks


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [True, False])
def test_pd_output_equals_colocated(prefill, decode, prompt, sampling, stream):
    req = request(prompt, params(**sampling), stream=stream, token_texts=True)
    result, chunks = assert_pd_equals_colocated(prefill, decode, req)
    transfer = result.transfer
    assert transfer.connector == "local" and transfer.num_tokens == len(prompt)
    assert transfer.nbytes == 2 * 2 * len(prompt) * 2 * 32 * 4  # K+V, 2 layers, 2 heads x 32
    assert result.chunk.kv_bytes == transfer.nbytes and result.chunk.steps
    assert result.chunk.choices[0].token_texts is not None
    assert result.chunk.steps[0].prefill_time_ms is not None
    assert (result.generator_state is not None) == ("seed" in sampling)
    head = chunks[0]
    assert head.handoff_ms is not None and head.kv_bytes == transfer.nbytes
    assert not head.kv_recomputed
    assert all(c.handoff_ms is None for c in chunks[1:])
    assert len(joined(chunks, "token_ids")) == 11  # the first token is never repeated
    # a chunk per token, or fewer where tokens coalesced while this consumer lagged (a busy
    # machine); one when not streaming
    assert 1 < len(chunks) <= 11 if stream else len(chunks) == 1
    assert chunks[-1].stats["num_kv_imports"] >= 1


def test_a_decode_replica_holds_chunks_for_stream_interval(prefill, decode, prompt):
    """PD with stream_interval 4: the prefill's first token at once, then the decode's first
    chunk (with the hand-off facts) at once, then 4 tokens a chunk; the same tokens and text as
    colocated."""
    req = request(prompt, params(), token_texts=True, stream_interval=4)
    _, chunks = assert_pd_equals_colocated(prefill, decode, req)
    assert [len(c.choices[0].token_ids) for c in chunks] == [1, 4, 4, 2]
    assert chunks[0].handoff_ms is not None


def test_limit_from_max_iter_times_gives_one_token_more(prefill, decode, prompt):
    _, chunks = run_pd(prefill, decode, request(prompt, params(None), stream=False))
    (choice,) = chunks[-1].choices
    assert choice.num_output_tokens == MAX_ITER + 1 and len(choice.token_ids) == MAX_ITER
    assert choice.finish_reason == "length"
    _, chunks = run_pd(prefill, decode, request(prompt, params(MAX_ITER), stream=False))
    assert chunks[-1].choices[0].num_output_tokens == MAX_ITER + 1  # not smaller: the same
    _, chunks = run_pd(prefill, decode, request(prompt, params(MAX_ITER - 1), stream=False))
    assert chunks[-1].choices[0].num_output_tokens == MAX_ITER - 1  # smaller: exact
    wait_idle(prefill, decode)


@dataclasses.dataclass(frozen=True)
class ForcedStart:
    """A constraint (the engine's hook) that forces the first tokens, then lets any through."""

    tokens: tuple[int, ...]

    def start(self, ctx):
        return _ForcedStartState(self.tokens)


@dataclasses.dataclass
class _ForcedStartState:
    tokens: tuple[int, ...]
    min_output_tokens: int = 0

    def mask(self, logits_row, output_ids, remaining):
        if len(output_ids) < len(self.tokens):
            token = self.tokens[len(output_ids)]
            value = logits_row[token].item()
            logits_row.fill_(float("-inf"))
            logits_row[token] = value


def split_char_params(tokenizer, max_tokens=6):
    """Greedy, but the first two tokens are forced to spell SPLIT_CHAR."""
    forced = tokenizer.encode(SPLIT_CHAR, add_special_tokens=False)
    assert len(forced) == 2 and tokenizer.decode(forced[:1]).endswith("\ufffd")
    return params(max_tokens, constraint=ForcedStart(tuple(forced))), forced


def test_first_token_in_the_middle_of_a_character(prefill, decode, prompt):
    sampling, forced = split_char_params(prefill.tokenizer)
    req = request(prompt, sampling, token_texts=True)
    result, chunks = assert_pd_equals_colocated(prefill, decode, req)
    assert result.first_text_held
    assert result.chunk.choices[0].text == "" and result.chunk.choices[0].token_texts == [""]
    assert chunks[0].choices[0].token_ids[0] == forced[1]
    assert chunks[0].choices[0].text.startswith(SPLIT_CHAR)


def test_processor_continues_after_a_held_first_token(prefill, prompt):
    """The detokenizer part alone: prefill holds the half character, decode releases it."""
    tokenizer = prefill.tokenizer
    forced = tokenizer.encode(SPLIT_CHAR + " ok", add_special_tokens=False)
    req = request(prompt, params())

    def output(tokens, new):
        co = CompletionOutput(0, tokens, new)
        return RequestOutput(req.request_id, list(prompt), [co], finished=True)

    chunk, held = OutputProcessor(req, tokenizer).process_first(
        output(forced[:1], forced[:1]), False
    )
    assert held and chunk.choices[0].text == "" and not chunk.finished
    rest = OutputProcessor(req, tokenizer, first_token_id=forced[0])
    out = output(forced, forced[1:])
    out.outputs[0].finish_reason = FinishReason.LENGTH
    delta = rest.process(out).choices[0]
    assert delta.text == SPLIT_CHAR + " ok" and delta.token_ids == forced[1:]
    assert delta.num_output_tokens == len(forced)


def test_output_limit_of_one_ends_at_prefill(prefill, prompt):
    result = asyncio.run(prefill.prefill(request(prompt, params(1))))
    assert result.transfer is None and result.chunk.finished
    (choice,) = result.chunk.choices
    assert choice.finish_reason == "length" and len(choice.token_ids) == 1
    assert choice.num_output_tokens == 1
    assert result.chunk.stats is not None and result.chunk.num_prompt_tokens == len(prompt)
    wait_idle(prefill)


def test_stop_token_first_ends_at_prefill(prefill, prompt):
    first = asyncio.run(prefill.prefill(request(prompt, params(1)))).chunk.choices[0].token_ids
    result = asyncio.run(prefill.prefill(request(prompt, params(8, stop_token_ids=first))))
    assert result.transfer is None and result.chunk.finished
    assert result.chunk.choices[0].finish_reason == "stop_token"
    wait_idle(prefill)


def test_rejected_prefill_is_an_error_chunk(prefill):
    result = asyncio.run(prefill.prefill(request([5] * 600, params())))
    assert result.transfer is None and result.chunk.finished
    assert result.chunk.error_kind == "rejected" and "prompt" in result.chunk.error


class ObjectLostError(RuntimeError):  # what Ray raises when the staged KV is gone
    pass


class LostConnector(LocalConnector):
    async def fetch(self, transfer):
        raise ObjectLostError("the prefill replica at /tmp/ray/session_x died")


class StuckConnector(LocalConnector):
    """A fetch that never ends; `entered` is set once a fetch is waiting in it."""

    def __init__(self):
        super().__init__()
        self.entered = asyncio.Event()

    async def fetch(self, transfer):
        self.entered.set()
        await asyncio.Event().wait()


def test_lost_kv_is_recomputed_by_default(prefill, decode, prompt, monkeypatch):
    monkeypatch.setattr(decode, "connector", LostConnector())
    req = request(prompt, params(**SEEDED))
    _, chunks = assert_pd_equals_colocated(prefill, decode, req)
    assert chunks[0].kv_recomputed and chunks[0].kv_bytes == 0
    assert decode.num_kv_lost >= 1


def test_lost_kv_fails_under_policy_fail(prefill, decode, prompt, monkeypatch):
    monkeypatch.setattr(decode, "connector", LostConnector())
    monkeypatch.setattr(decode, "kv_loss_policy", "fail")
    _, chunks = run_pd(prefill, decode, request(prompt, params()))
    (final,) = chunks
    assert final.finished and final.error_kind == "engine"
    assert "kv_loss_policy" in final.error and "ObjectLostError" in final.error
    assert "/tmp/ray" not in final.error  # the kind, not the internals
    wait_idle(prefill, decode)


def test_closing_decode_early_frees_blocks_on_both_replicas(prefill, decode, prompt):
    req = request(prompt, params(MAX_ITER))

    async def run():
        result = await prefill.prefill(req)
        first = result.chunk.choices[0].token_ids[0]
        stream = decode.decode(DecodeRequest(req, first, result.transfer))
        chunk = await stream.__anext__()
        assert decode.engine.stats()["num_running"] == 1
        await stream.aclose()
        return chunk

    assert not asyncio.run(run()).finished
    wait_idle(prefill, decode)


def test_cancel_during_fetch_and_during_prefill(prefill, decode, prompt, monkeypatch):
    stuck = StuckConnector()
    monkeypatch.setattr(decode, "connector", stuck)
    req = request(prompt, params())

    async def run():
        result = await prefill.prefill(req)
        first = result.chunk.choices[0].token_ids[0]
        task = asyncio.ensure_future(
            decode.decode(DecodeRequest(req, first, result.transfer)).__anext__()
        )
        await asyncio.wait_for(stuck.entered.wait(), 30)  # the decode is inside its fetch
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        task = asyncio.ensure_future(prefill.prefill(request(list(prompt) * 4, params())))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    wait_idle(prefill, decode)
    assert not decode.engine.engine.requests and not prefill.engine.engine.requests


def test_stats_name_the_role(prefill, decode):
    # (a colocated replica's: tests/replica/test_model_replica.py)
    stats = [asyncio.run(r.stats()) for r in (prefill, decode)]
    assert [s["role"] for s in stats] == ["prefill", "decode"]
    with pytest.raises(ValueError, match="role"):
        ModelReplica(load_config(CONFIG), role="mixed")


def test_the_request_timeout_covers_the_hand_off(prefill, decode, prompt, monkeypatch):
    monkeypatch.setattr(decode, "connector", StuckConnector())
    req = request(prompt, params(), timeout_s=0.3)
    start = time.monotonic()
    _, chunks = run_pd(prefill, decode, req)
    assert time.monotonic() - start < 3
    assert chunks[-1].finished and chunks[-1].error_kind == "timeout"
    assert "hand-off" in chunks[-1].error
    wait_idle(prefill, decode)
