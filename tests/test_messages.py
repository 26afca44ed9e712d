"""ReplicaChunk.absorb: how a stream's chunks fold into fewer (coalescing, stream_interval,
non-stream responses)."""

from serve_app.messages import ChoiceDelta, ReplicaChunk, StepInfo


def chunk(*deltas, steps=1, **kw):
    return ReplicaChunk("r", choices=list(deltas), steps=[StepInfo(1, 0.0)] * steps, **kw)


def delta(index, ids, text, **kw):
    return ChoiceDelta(index=index, token_ids=list(ids), text=text, **kw)


def test_one_choice_folds_in_place_and_leaves_the_later_chunk_as_it_was():
    first = chunk(delta(0, [1], "a", num_output_tokens=1))
    later = chunk(delta(0, [2, 3], "bc", num_output_tokens=3, finish_reason="length"), steps=2)
    later_ids = later.choices[0].token_ids
    first.absorb(later)
    (c,) = first.choices
    assert (c.token_ids, c.text, c.num_output_tokens, c.finish_reason) == (
        [1, 2, 3], "abc", 3, "length",
    )  # fmt: skip
    assert len(first.steps) == 3 and later.choices[0].token_ids is later_ids == [2, 3]


def test_choices_fold_by_index_whatever_their_order():
    first = chunk(delta(1, [5], "x"))
    first.absorb(chunk(delta(0, [1], "a"), delta(1, [6], "y")))
    first.absorb(chunk(delta(0, [2], "b")))
    assert [(c.index, c.token_ids, c.text) for c in first.choices] == [
        (0, [1, 2], "ab"), (1, [5, 6], "xy"),
    ]  # fmt: skip


def test_the_final_chunks_facts_win():
    first = chunk(delta(0, [1], "a"))
    first.absorb(chunk(delta(0, [2], "b"), finished=True, num_prompt_tokens=7, error="e"))
    assert first.finished and first.num_prompt_tokens == 7 and first.error == "e"


def test_one_choice_each_of_different_indices_are_two_choices():
    first = chunk(delta(1, [5], "x"))
    first.absorb(chunk(delta(0, [1], "a")))
    assert [(c.index, c.token_ids) for c in first.choices] == [(0, [1]), (1, [5])]
