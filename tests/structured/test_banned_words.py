"""Banned words (Triton's bad_words): which logits a state bars, and the spellings it bars."""

from __future__ import annotations

import pickle

import torch

from serve_app.engine.constraint import ConstraintContext
from serve_app.structured.banned_words import BannedWords, BannedWordsState, spellings


def _barred(state: BannedWordsState, output_ids: list[int]) -> set[int]:
    row = torch.zeros(10)
    state.mask(row, output_ids, remaining=5)
    return {i for i in range(10) if row[i] == float("-inf")}


def test_a_one_token_word_is_always_barred_a_longer_one_only_after_its_start():
    state = BannedWordsState(((3,), (5, 6, 7), (8, 9)))
    assert _barred(state, []) == {3}
    assert _barred(state, [1, 5]) == {3}  # 5 alone is not (5, 6)
    assert _barred(state, [1, 5, 6]) == {3, 7}
    assert _barred(state, [8]) == {3, 9}
    assert _barred(state, [8, 1]) == {3}


def test_words_are_spelt_as_given_and_after_a_space(demo_path):
    from serve_app.models.loader import load_tokenizer

    tokenizer = load_tokenizer(demo_path)
    found = spellings(str(demo_path), ("hello world",))
    assert tuple(tokenizer.encode("hello world", add_special_tokens=False)) in found
    assert tuple(tokenizer.encode(" hello world", add_special_tokens=False)) in found
    assert spellings(str(demo_path), (" x",)) == (
        tuple(tokenizer.encode(" x", add_special_tokens=False)),
    )


def test_the_spec_is_picklable_and_starts_a_state(demo_path):
    spec = pickle.loads(pickle.dumps(BannedWords(("hello",))))
    ctx = ConstraintContext(str(demo_path), vocab_size=151936, eos_token_ids=(151643,))
    state = spec.start(ctx)
    row = torch.zeros(151936)
    state.mask(row, [], remaining=3)
    singles = {s[0] for s in spellings(str(demo_path), ("hello",)) if len(s) == 1}
    assert singles and set(torch.isinf(row).nonzero()[:, 0].tolist()) == singles
    assert state.min_output_tokens == 0
