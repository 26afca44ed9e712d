"""The Encoder on the built-in all-MiniLM-L6-v2 (no Ray): sentence-transformers' vectors, in
order whatever the batching, token counts as usage counts them, and refusals naming input[i]."""

from __future__ import annotations

import math

import pytest

from serve_app.embedding import Encoder, InputRefused
from serve_app.models import minilm
from serve_app.models.loader import resolve_model_path

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The stock market fell sharply today.",
    "A woman is playing the violin.",
    "A girl plays a string instrument on stage in front of a large and quiet audience.",
    "Ok",
    "Pricing: the new phone costs $999, ships in 3-5 days and comes in three colours.",
    " ".join(["a long sentence about nothing in particular"] * 20),
]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # the vectors have unit norm


@pytest.fixture(scope="module")
def folder():
    return resolve_model_path(minilm.NAME)


@pytest.fixture(scope="module")
def encoder(folder):
    return Encoder(folder, max_batch_size=32)


@pytest.fixture(scope="module")
def encoded(encoder):
    return encoder.encode(TEXTS)


def test_vectors_have_384_dimensions_and_unit_norm(encoder, encoded):
    vectors, _ = encoded
    assert encoder.dimensions == 384 and encoder.max_input_tokens == 256
    assert len(vectors) == len(TEXTS)
    for vector in vectors:
        assert len(vector) == 384
        assert math.sqrt(sum(x * x for x in vector)) == pytest.approx(1.0, abs=1e-5)


def test_vectors_equal_sentence_transformers(folder, encoded):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    expected = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    vectors, _ = encoded
    worst = max(abs(a - b) for row, ref in zip(vectors, expected, strict=True)
                for a, b in zip(row, ref.tolist(), strict=True))  # fmt: skip
    assert worst < 1e-5


def test_batches_keep_the_input_order_with_mixed_lengths(folder, encoded):
    """Small batches formed by length (so each pads little) still answer in input order, and
    padding changes no vector."""
    small = Encoder(folder, max_batch_size=3)
    shuffled = [TEXTS[i] for i in (7, 0, 5, 2, 6, 1, 4, 3)]
    vectors, counts = small.encode(shuffled)
    alone = {text: small.encode([text])[0][0] for text in TEXTS}
    by_text = dict(zip(TEXTS, encoded[0], strict=True))
    for text, vector in zip(shuffled, vectors, strict=True):
        assert max(abs(a - b) for a, b in zip(vector, by_text[text], strict=True)) < 1e-5
        assert max(abs(a - b) for a, b in zip(vector, alone[text], strict=True)) < 1e-5
    assert counts == [encoded[1][TEXTS.index(text)] for text in shuffled]


def test_related_sentences_are_closer_than_unrelated_ones(encoded):
    v = dict(zip(TEXTS, encoded[0], strict=True))
    eating, bread, stocks, violin, strings = TEXTS[:5]
    assert cosine(v[eating], v[bread]) > cosine(v[eating], v[stocks]) + 0.3
    assert cosine(v[violin], v[strings]) > cosine(v[violin], v[stocks])
    assert cosine(v[violin], v[strings]) > cosine(v[violin], v[eating])


def test_token_counts_include_cls_and_sep(encoder, encoded):
    # [CLS] a man is eating food . [SEP]
    assert encoded[1][0] == 8
    assert encoded[1] == [len(encoder.tokenizer(text)["input_ids"]) for text in TEXTS]
    assert encoder.tokenize(["Ok"]) == [[101, 7929, 102]]


def _text_of(encoder: Encoder, num_tokens: int) -> str:
    text = " ".join(["hello"] * (num_tokens - 2))  # one token per word, plus [CLS] and [SEP]
    assert len(encoder.tokenize([text])[0]) == num_tokens
    return text


def test_the_longest_input_fits_and_a_longer_one_is_refused_not_cut(encoder):
    longest = _text_of(encoder, 256)
    vectors, counts = encoder.encode(["short", longest])
    assert counts[1] == 256 and len(vectors[1]) == 384
    with pytest.raises(InputRefused) as refused:
        encoder.encode(["short", longest + " hello"])
    assert refused.value.param == "input[1]"
    assert "input[1] is 257 tokens long" in refused.value.message
    assert "at most 256 tokens" in refused.value.message


@pytest.mark.parametrize("empty", ["", "   ", "\n\t"])
def test_an_empty_input_is_refused_by_its_index(encoder, empty):
    with pytest.raises(InputRefused, match=r"input\[2\] has no text to embed") as refused:
        encoder.encode(["one", "two", empty])
    assert refused.value.param == "input[2]"


def test_refusals_name_the_callers_parameter(encoder):
    with pytest.raises(InputRefused) as refused:
        encoder.encode(["fine", "\ud83d"], param="inputs")
    assert refused.value.param == "inputs[1]"
    assert "not valid Unicode text" in refused.value.message


def test_no_texts_no_vectors(encoder):
    assert encoder.encode([]) == ([], [])
