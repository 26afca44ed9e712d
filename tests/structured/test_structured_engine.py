"""Structured output through the engine with the random demo-tiny model, sampling at temperature
1: every output parses and validates within max_tokens, or the engine refuses a max_tokens that
cannot hold the shortest one; also with n = 2, after preemptions, across a PD hand-off and in
the engine's own process (where the constraint arrives pickled)."""

import asyncio

import pytest
from structured_helpers import ANY_OBJECT, SCHEMAS, assert_idle, assert_valid

from serve_app.engine import (
    LLM,
    EngineConfig,
    EngineRequest,
    FinishReason,
    RequestRejected,
    SamplingParams,
)
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.kv_transfer import ImportedPrefill
from serve_app.engine.llm_engine import LLMEngine
from serve_app.models.loader import load_tokenizer, resolve_model_path
from serve_app.structured import json_object, json_schema

BASE = dict(
    model="demo-tiny", dtype="float32", device="cpu", max_seq_len=1024, max_input_token_len=256,
    max_prefill_tokens=1024, max_iter_times=256, block_size=16,
)  # fmt: skip
CHAT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # user: Hello / assistant:
CASES = {**SCHEMAS, "object": ANY_OBJECT}


def constraint_of(name):
    return json_object() if name == "object" else json_schema(CASES[name])


@pytest.fixture(scope="module")
def llm():
    return LLM(**{**BASE, "num_kv_blocks": 256})


def sampled(constraint, max_tokens, seed, n=2):
    return SamplingParams(
        temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, constraint=constraint
    )


def assert_all_valid(outputs, schema, max_tokens):
    for output in outputs:
        for completion in output.outputs:
            assert len(completion.token_ids) <= max_tokens
            assert completion.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
            assert_valid(completion.text, schema)


@pytest.mark.parametrize("max_tokens", [12, 30, 100])
@pytest.mark.parametrize("name", list(CASES))
def test_every_output_validates_within_max_tokens(llm, name, max_tokens):
    constraint = constraint_of(name)
    shortest = constraint.start(llm.engine.updater.constraint_context).min_output_tokens
    if shortest > max_tokens:
        with pytest.raises(RequestRejected, match=f"below the {shortest} tokens"):
            llm.generate([CHAT], sampled(constraint, max_tokens, 0))
        assert_idle(llm)
        return
    params = [sampled(constraint, max_tokens, seed) for seed in range(3)]
    outputs = llm.generate([CHAT] * 3, params)
    assert_all_valid(outputs, CASES[name], max_tokens)
    texts = {c.text for o in outputs for c in o.outputs}
    if max_tokens >= 30 and name != "object":
        assert len(texts) > 1  # sampling still varies under the grammar
    assert_idle(llm)


def test_preempted_sequences_resume_their_grammar():
    """A pool that holds about two requests at a time: the others are preempted and
    recomputed, and their grammar states carry on from the output they keep."""
    llm = LLM(**{**BASE, "num_kv_blocks": 12})  # 6 blocks of 16 tokens per request
    constraint = json_schema(SCHEMAS["mixed"])
    outputs = llm.generate([CHAT] * 4, [sampled(constraint, 80, s, n=1) for s in range(4)])
    assert llm.engine.stats()["num_preemptions"] > 0
    assert_all_valid(outputs, SCHEMAS["mixed"], 80)
    assert_idle(llm)


def _run(engine):
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


def test_pd_hand_off_continues_the_grammar_as_colocated(llm):
    """The prefill engine plans for the whole output (its own cap is one token); the decode
    engine's fresh state accepts the prefill's first token and goes on: the same tokens as one
    colocated engine."""
    # the module's engine is the colocated one, then the decode (idle again after each run); the
    # prefill is an engine of its own, with a pool of its own (the one prompt needs one block)
    colocated = decode = llm.engine
    prefill = LLMEngine(EngineConfig(**{**BASE, "num_kv_blocks": 4}))
    params = sampled(json_schema(SCHEMAS["person"]), 40, seed=5, n=1)
    colocated.add_request(EngineRequest("c", CHAT, params))
    expected = _run(colocated)["c"].outputs[0].token_ids
    prefill.add_request(EngineRequest("p", CHAT, params, export_kv=True))
    out = _run(prefill)["p"]
    first = out.outputs[0].token_ids[0]
    imported = ImportedPrefill(first, out.kv_payload, out.generator_state, max_output_tokens=40)
    decode.add_request(EngineRequest("d", CHAT, params, imported=imported))
    tokens = _run(decode)["d"].outputs[0].token_ids
    assert tokens == expected
    assert_valid(decode.tokenizer.decode(tokens, skip_special_tokens=True), SCHEMAS["person"])


def test_the_engine_process_receives_the_constraint_pickled():
    engine = AsyncEngine(EngineConfig(**{**BASE, "num_kv_blocks": 64, "engine_process": True}))

    async def tokens(request_id, seed):
        params = sampled(json_schema(SCHEMAS["nested"]), 60, seed, n=1)
        ids = []
        async for output in engine.generate(EngineRequest(request_id, CHAT, params)):
            ids += output.outputs[0].new_token_ids
        return ids

    async def both():
        return await asyncio.gather(tokens("a", 1), tokens("b", 2))

    try:
        results = asyncio.run(both())
    finally:
        engine.shutdown()
    tokenizer = load_tokenizer(resolve_model_path("demo-tiny"))
    for ids in results:
        assert 0 < len(ids) <= 60
        assert_valid(tokenizer.decode(ids, skip_special_tokens=True), SCHEMAS["nested"])


# One "," opens an item whose required keys alone need ~90 tokens: the state must not let it
# through when the budget left cannot close it (found in review: the window was too narrow).
WIDE_ITEM = {
    "type": "object",
    "properties": {f"property_number_{i}_with_a_long_name": {"type": "integer"} for i in range(12)},
    "required": [f"property_number_{i}_with_a_long_name" for i in range(12)],
}
GROWING = {"type": "array", "items": WIDE_ITEM}


# 160: just room for one item (the shortest one-item array takes 160 tokens), not for a second;
# 300: past the engine's maxIterTimes (256), which is then the budget the state must close in
@pytest.mark.parametrize("max_tokens", [160, 300])
def test_a_token_that_opens_a_long_item_is_held_back_near_the_end(llm, max_tokens):
    outputs = llm.generate([CHAT], sampled(json_schema(GROWING), max_tokens, seed=0))
    assert_all_valid(outputs, GROWING, max_tokens)
    assert_idle(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4])
def test_a_complete_number_is_not_extended_past_the_budget(llm, max_tokens):
    schema = {"type": "number"}
    params = [sampled(json_schema(schema), max_tokens, seed) for seed in range(4)]
    outputs = llm.generate([CHAT] * 4, params)
    assert_all_valid(outputs, schema, max_tokens)
