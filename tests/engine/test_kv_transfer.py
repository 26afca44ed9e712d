"""Prefill/decode hand-off in the engine: one engine prefills and exports the prompt's KV, a
second one imports it and continues; the tokens must equal one colocated engine's, token for
token, greedy and seeded sampling alike."""

import dataclasses
import sys

import pytest
import torch
from engine_helpers import run_to_end as run

from serve_app.engine import (
    EngineConfig,
    EngineRequest,
    FinishReason,
    RequestRejected,
    SamplingParams,
    kv_transfer,
)
from serve_app.engine.kv_transfer import ImportedPrefill, KVPayload
from serve_app.engine.llm_engine import LLMEngine
from serve_app.tokenizer.limits import TokenLimits

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

MAX_ITER = 12
BASE = dict(
    model="demo-tiny",
    dtype="float32",
    device="cpu",
    max_seq_len=512,
    max_input_token_len=256,
    max_prefill_tokens=256,
    max_iter_times=MAX_ITER,
)
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
GREEDY_EOS = SamplingParams(temperature=0)
SEEDED = SamplingParams(
    temperature=1.0,
    top_k=50,
    seed=1234,
    ignore_eos=True,
    repetition_penalty=1.3,
    presence_penalty=0.5,
)


def make_engine(**overrides):
    return LLMEngine(EngineConfig(**{**BASE, "block_size": 16, "num_kv_blocks": 64, **overrides}))


@pytest.fixture(scope="module")
def colocated():
    return make_engine()


@pytest.fixture(scope="module")
def prefill():
    # chunked prefill: a 32-token budget splits the longer prompts over several steps
    return make_engine(max_prefill_tokens=32, max_input_token_len=32)


@pytest.fixture(scope="module")
def decode():
    return make_engine(block_size=8, num_kv_blocks=128)  # another block size: layout-free KV


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(0, 151643, (n,), generator=generator).tolist() for n in (1, 7, 40, 75)]


def assert_idle(*engines):
    for engine in engines:
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert not engine.requests


def limits(engine):
    c = engine.config
    return TokenLimits(c.max_seq_len, c.max_input_token_len, c.max_iter_times, c.truncation)


def colocated_tokens(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"c{i}", prompt, params))
    done = run(engine)
    return [done[f"c{i}"].outputs[0].token_ids for i in range(len(prompts))]


def export(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", prompt, params, export_kv=True))
    done = run(engine)
    return [done[f"p{i}"] for i in range(len(prompts))]


def pd_tokens(prefill, decode, prompts, params, recompute=False):
    total = limits(prefill).pd_total_tokens(params.max_tokens)
    exported = export(prefill, prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, exported, strict=True)):
        assert out.outputs[0].token_ids == out.outputs[0].new_token_ids  # exactly one token
        assert len(out.outputs[0].token_ids) == 1
        assert out.outputs[0].finish_reason == FinishReason.LENGTH
        assert out.kv_payload.num_tokens == len(prompt)
        assert (out.generator_state is not None) == (params.seed is not None)
        kv = None if recompute else out.kv_payload
        first = out.outputs[0].token_ids[0]
        imported = ImportedPrefill(first, kv, out.generator_state, max_output_tokens=total)
        decode.add_request(EngineRequest(f"d{i}", prompt, params, imported=imported))
    done = run(decode)
    tokens = []
    for i in range(len(prompts)):
        completion = done[f"d{i}"].outputs[0]
        assert completion.token_ids[0] == exported[i].outputs[0].token_ids[0]
        tokens.append(completion.token_ids)
    return tokens


def test_gather_scatter_round_trip_across_block_sizes():
    torch.manual_seed(0)
    src = [(torch.randn(8, 4, 2, 3), torch.randn(8, 4, 2, 3)) for _ in range(2)]
    dst = [(torch.zeros(6, 8, 2, 3), torch.zeros(6, 8, 2, 3)) for _ in range(2)]
    payload = kv_transfer.gather(src, [5, 1, 7], 10, 4)  # 10 tokens over blocks 5, 1, 7
    assert payload.keys[0].shape == (10, 2, 3) and payload.keys[0].device.type == "cpu"
    assert payload.nbytes == 2 * 2 * 10 * 2 * 3 * 4
    torch.testing.assert_close(payload.keys[1][4:8], src[1][0][1])
    torch.testing.assert_close(payload.values[0][8:], src[0][1][7, :2])
    kv_transfer.scatter(dst, [3, 0], payload, 8)
    again = kv_transfer.gather(dst, [3, 0], 10, 8)
    for a, b in zip(payload.keys + payload.values, again.keys + again.values, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="layers"):
        kv_transfer.scatter(dst[:1], [3, 0], payload, 8)
    with pytest.raises(ValueError, match="blocks"):
        kv_transfer.scatter(dst, [3], payload, 8)


def test_runner_read_write_round_trip(prefill, decode, prompts):
    out = export(prefill, prompts[2:3], GREEDY)[0]
    payload = out.kv_payload
    assert payload.dtype == torch.float32 and payload.read_ms >= 0
    assert len(payload.keys) == prefill.runner.hf_config.num_hidden_layers
    blocks = decode.kv.pool.allocate(5)  # 40 tokens in blocks of 8
    decode.runner.write_kv(blocks, payload)
    back = decode.runner.read_kv(blocks, payload.num_tokens)
    decode.kv.pool.release(blocks)
    for a, b in zip(payload.keys + payload.values, back.keys + back.values, strict=True):
        assert torch.equal(a, b)
    assert_idle(prefill, decode)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_tokens", [None, 5], ids=["maxIterTimes", "max_tokens"])
def test_pd_equals_colocated(colocated, prefill, decode, prompts, params, max_tokens):
    params = dataclasses.replace(params, max_tokens=max_tokens)
    expected = colocated_tokens(colocated, prompts, params)
    got = pd_tokens(prefill, decode, prompts, params)
    if max_tokens is None:  # the limit is maxIterTimes: decode still runs maxIterTimes steps
        assert all(len(t) == MAX_ITER + 1 for t in got)
        got = [t[:MAX_ITER] for t in got]
    else:
        assert all(len(t) == max_tokens for t in got)
    assert got == expected
    assert_idle(colocated, prefill, decode)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_recompute_equals_colocated(colocated, prefill, decode, prompts, params):
    params = dataclasses.replace(params, max_tokens=6)
    expected = colocated_tokens(colocated, prompts, params)
    assert pd_tokens(prefill, decode, prompts, params, recompute=True) == expected
    assert_idle(colocated, prefill, decode)


def test_prefix_cache_hit_still_exports_the_whole_prompt(prefill, decode, prompts):
    prompt = prompts[3]  # 75 tokens: four full 16-token blocks can be reused
    first = export(prefill, [prompt], GREEDY)[0].kv_payload
    hits = prefill.stats()["prefix_cache_hits"]
    again = export(prefill, [prompt], GREEDY)[0].kv_payload
    assert prefill.stats()["prefix_cache_hits"] >= hits + 4
    assert again.num_tokens == len(prompt)
    for a, b in zip(first.keys + first.values, again.keys + again.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert_idle(prefill)


def test_first_token_that_ends_the_request(prefill, decode, prompts):
    eos = min(decode.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=5)
    decode.add_request(
        EngineRequest("eos", prompts[1], params, imported=ImportedPrefill(eos, None))
    )
    out = run(decode)["eos"].outputs[0]
    assert out.finish_reason == FinishReason.EOS
    assert out.token_ids == [eos] and out.new_token_ids == []
    limit_one = export(prefill, prompts[1:2], GREEDY)[0]
    first = limit_one.outputs[0].token_ids[0]
    imported = ImportedPrefill(first, limit_one.kv_payload, None, max_output_tokens=1)
    decode.add_request(EngineRequest("one", prompts[1], GREEDY, imported=imported))
    out = run(decode)["one"].outputs[0]
    assert out.finish_reason == FinishReason.LENGTH and out.new_token_ids == []
    assert_idle(prefill, decode)


def test_export_skips_the_kv_when_the_first_token_is_eos(prefill, prompts):
    # stop_token_ids with the token greedy picks first: the request ends at its first token
    first = export(prefill, prompts[:1], GREEDY)[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, stop_token_ids=[first])
    out = export(prefill, prompts[:1], params)[0]
    assert out.outputs[0].finish_reason == FinishReason.STOP_TOKEN
    assert out.kv_payload is None
    assert_idle(prefill)


def test_refusals_leave_no_state(decode, prompts):
    bad = KVPayload(3, [torch.zeros(3, 2, 32)], [torch.zeros(3, 2, 32)], torch.float32)
    with pytest.raises(ValueError, match="layers"):
        decode.add_request(
            EngineRequest("bad", prompts[1][:3], GREEDY, imported=ImportedPrefill(5, bad))
        )
    with pytest.raises(ValueError, match="covers"):
        decode.add_request(
            EngineRequest("bad", prompts[1], GREEDY, imported=ImportedPrefill(5, bad))
        )
    with pytest.raises(ValueError, match="one sequence"):
        decode.add_request(EngineRequest("n2", prompts[1], SamplingParams(n=2), export_kv=True))
    assert_idle(decode)


def test_a_request_imports_or_exports_and_is_rejected_as_such(decode, prompts):
    both = EngineRequest(
        "both", prompts[1], GREEDY, export_kv=True, imported=ImportedPrefill(5, None)
    )
    with pytest.raises(RequestRejected, match="either exports"):
        decode.add_request(both)
    assert_idle(decode)


def test_abort_of_a_request_its_first_token_ended_before_its_report(decode, prompts):
    eos = min(decode.eos_token_ids)
    imported = ImportedPrefill(eos, None)
    decode.add_request(EngineRequest("eos", prompts[1], GREEDY_EOS, imported=imported))
    assert decode.stats()["num_waiting"] == 0  # nothing to run: only its report is due
    final = decode.abort("eos")
    assert final.finished and final.outputs[0].finish_reason == FinishReason.EOS
    assert decode.step() == []
    assert_idle(decode)


def test_abort_while_waiting_for_room_and_after_import(prefill, prompts):
    small = make_engine(num_kv_blocks=7)  # room for one 75-token import at a time
    exported = export(prefill, [prompts[3], prompts[3]], GREEDY)
    for i, out in enumerate(exported):
        imported = ImportedPrefill(out.outputs[0].token_ids[0], out.kv_payload, max_output_tokens=8)
        small.add_request(EngineRequest(f"d{i}", prompts[3], GREEDY, imported=imported))
    imported = ImportedPrefill(5, None, None, max_output_tokens=100)
    with pytest.raises(ValueError, match="KV blocks"):  # can never fit: refused up front
        small.add_request(EngineRequest("big", prompts[3], GREEDY, imported=imported))
    small.step()
    assert small.stats()["num_waiting"] == 1  # the second waits for room, holding no blocks
    small.abort("d1")
    small.abort("d0")
    assert_idle(small)
    for i, out in enumerate(exported):  # without aborts both finish, one after the other
        imported = ImportedPrefill(out.outputs[0].token_ids[0], out.kv_payload, max_output_tokens=8)
        small.add_request(EngineRequest(f"e{i}", prompts[3], GREEDY, imported=imported))
    done = run(small)
    assert done["e0"].outputs[0].token_ids == done["e1"].outputs[0].token_ids
    assert small.stats()["num_kv_imports"] == 3
    assert_idle(small, prefill)


def test_import_into_the_npu_backend_layout(colocated, prefill, prompts, monkeypatch):
    """The NPU kernels read the same paged layout the import writes (with the repo's fake
    torch_npu): a torch-backend prefill continued on an NPU-backend decode engine."""
    from test_npu_attention import FakeTorchNpu

    from serve_app.engine.backends.npu import attention as npu_attention

    fake = FakeTorchNpu()
    fake.allow_float32 = True  # compared token for token with a float32 colocated engine
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    npu_decode = make_engine(block_size=128, num_kv_blocks=4)
    npu_decode.runner.model.set_attn_implementation(npu_attention.register())
    params = dataclasses.replace(GREEDY, max_tokens=6)
    expected = colocated_tokens(colocated, prompts, params)
    assert pd_tokens(prefill, npu_decode, prompts, params) == expected
    assert "paged_attention" in fake.names()
    assert_idle(colocated, prefill, npu_decode)
