"""The grammar state on its own, on the demo's Qwen2 vocabulary (151936 wide) and random logits:
outputs complete within any budget the state accepted, a state replayed from the output ids
masks as the incremental one did, and refused tokens end the sequence instead of the step."""

import pytest
import torch
from structured_helpers import ANY_OBJECT, MIXED, NESTED, PERSON, assert_valid

from serve_app.engine.constraint import ConstraintContext
from serve_app.models.loader import load_tokenizer
from serve_app.structured import json_object, json_schema, min_output_tokens

EOS = 151645
CASES = {"person": PERSON, "mixed": MIXED, "nested": NESTED, "object": ANY_OBJECT}


def constraint_of(name):
    return json_object() if name == "object" else json_schema(CASES[name])


@pytest.fixture(scope="module")
def ctx(demo_path):
    return ConstraintContext(str(demo_path), 151936, (EOS,))


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    return load_tokenizer(demo_path)


def generate(state, budget, seed, scale=3.0):
    """Sample from random logits through the state until EOS or the budget: the output ids."""
    g = torch.Generator().manual_seed(seed)
    output = []
    for step in range(budget):
        row = torch.randn(151936, generator=g) * scale
        state.mask(row, output, budget - step)
        assert torch.isfinite(row).any()
        token = int(torch.multinomial(row.softmax(0), 1, generator=g))
        output.append(token)
        if token == EOS:
            break
    return output


def text_of(tokenizer, output):
    return tokenizer.decode([t for t in output if t != EOS])


@pytest.mark.parametrize("name", list(CASES))
def test_every_budget_from_the_shortest_output_up_ends_complete(ctx, tokenizer, name):
    constraint = constraint_of(name)
    shortest = constraint.start(ctx).min_output_tokens
    assert 0 < shortest <= 60
    for seed, extra in enumerate([0, 1, 2, 5, 13, 40, 90]):
        budget = shortest + extra
        output = generate(constraint.start(ctx), budget, seed)
        assert len(output) <= budget
        assert_valid(text_of(tokenizer, output), CASES[name])


@pytest.mark.parametrize(
    "name, budget",
    [("mixed", 90), ("person", 200), ("object", 150)],
    ids=["within-the-window", "into-the-window", "any-object"],
)
def test_a_replayed_state_masks_as_the_incremental_one(ctx, name, budget):
    """A fresh state given the whole output so far (a best_of fork, a PD hand-off) masks
    exactly as the state that saw it token by token, outside the closing window, inside it
    (every step plans and checks candidates) and across its edge."""
    constraint = constraint_of(name)
    incremental = constraint.start(ctx)
    g = torch.Generator().manual_seed(7)
    output = []
    for step in range(budget):
        raw = torch.randn(151936, generator=g) * 3.0
        row, replayed = raw.clone(), raw.clone()
        incremental.mask(row, output, budget - step)
        constraint.start(ctx).mask(replayed, list(output), budget - step)
        assert torch.equal(row, replayed)
        token = int(torch.multinomial(row.softmax(0), 1, generator=g))
        output.append(token)
        if token == EOS:
            break
    assert output[-1] == EOS or len(output) == budget


def test_min_output_tokens_is_the_states(ctx, demo_path):
    assert min_output_tokens(json_object(), demo_path) == 2  # {}
    person = json_schema(PERSON)
    assert min_output_tokens(person, demo_path) == person.start(ctx).min_output_tokens


def test_a_refused_token_leaves_only_eos(ctx, tokenizer):
    state = json_schema(PERSON).start(ctx)
    row = torch.zeros(151936)
    not_json = tokenizer.encode("hello", add_special_tokens=False)
    state.mask(row, not_json, 50)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS]


def test_a_complete_output_allows_only_eos(ctx, tokenizer):
    state = json_object().start(ctx)
    row = torch.zeros(151936)
    state.mask(row, tokenizer.encode("{}", add_special_tokens=False), 50)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [EOS]


def test_no_raw_control_character_inside_strings(ctx, tokenizer):
    """xgrammar's minLength string rule lets a raw tab through; the state does not."""
    state = json_schema({"type": "string", "minLength": 40}).start(ctx)
    tab_tokens = [t for t in range(151643) if "\t" in tokenizer.decode([t])][:50]
    output = tokenizer.encode('"', add_special_tokens=False)
    for _ in range(10):
        row = torch.zeros(151936)
        row[tab_tokens] = 100.0  # the tabs are the model's favourites
        state.mask(row, output, 100)
        assert not torch.isfinite(row[tab_tokens]).any()
        output.append(int(row.argmax()))
