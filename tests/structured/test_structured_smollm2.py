"""A real model under a schema: SmolLM2-135M-Instruct, asked in a chat for a person as JSON,
greedy, answers schema-valid JSON with the content it was asked for."""

import pytest
from structured_helpers import PERSON, assert_valid

from serve_app.engine import LLM, FinishReason, SamplingParams
from serve_app.structured import from_response_format

QUESTION = (
    "Describe a person named Alice who is 30 years old as a JSON object with the keys name and age."
)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    # one request at a time, of at most maxSeqLen tokens (4 blocks of 128): a pool of 8 blocks,
    # not the 2 GiB one the engine takes on CPU when kvCacheBlocks is not given
    return LLM(
        str(smollm2_path), dtype="float32", maxSeqLen=512, maxInputTokenLen=256,
        maxPrefillTokens=512, maxIterTimes=64, kvCacheBlocks=8,
    )  # fmt: skip


def chat_ids(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
def test_smollm2_answers_the_json_it_was_asked_for(llm, response_format):
    constraint = from_response_format(response_format)
    params = SamplingParams(temperature=0, max_tokens=40, constraint=constraint)
    (output,) = llm.generate([chat_ids(llm.tokenizer, QUESTION)], params)
    completion = output.outputs[0]
    value = assert_valid(completion.text, PERSON)
    assert value == {"name": "Alice", "age": 30}
    assert completion.finish_reason == FinishReason.EOS  # it closed the object itself


def test_a_tight_budget_still_ends_in_valid_json(llm):
    """Too few tokens for the model's own answer: the state closes the object in time."""
    constraint = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    )
    prompt = chat_ids(llm.tokenizer, "Write a long biography of Alice as JSON, name and age.")
    for max_tokens in (12, 16):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, constraint=constraint)
        (output,) = llm.generate([prompt], params)
        assert len(output.outputs[0].token_ids) <= max_tokens
        assert_valid(output.outputs[0].text, PERSON)
