"""IncrementalDetokenizer against the real Qwen2 byte-level BPE of the demo model."""

from __future__ import annotations

import random

import pytest

from serve_app.models.demo import ensure_demo_model
from serve_app.models.loader import load_tokenizer
from serve_app.tokenizer.detokenizer import IncrementalDetokenizer

IM_START, IM_END, EOT = 151644, 151645, 151643
TEXTS = [
    "你好，世界！今天天气很好。",
    "emoji 😀🦜🫠👩‍👩‍👧 and flags 🇯🇵🇨🇳",
    "Mixed 中文 and English: def 函数(x): return x ** 2  # 平方\n\tprint('龘𠀀靐')",
    "  leading spaces,  double  spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_demo_model("demo-tiny"))


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 4)  # empty pushes happen too (a step with no new tokens)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def stream(tok, chunks: list[list[int]], skip: bool = True, prompt=None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push(c) for c in chunks] + [detok.flush()]
    assert detok.text == "".join(deltas)
    assert detok.token_ids == [t for c in chunks for t in c]
    return deltas


def test_texts_split_characters_across_tokens(tok):
    # The test is only meaningful if some tokens really are partial UTF-8.
    ids = [t for text in TEXTS for t in tok.encode(text)]
    assert any("\ufffd" in tok.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_emits_partial_characters(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push_one(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text == tok.decode(ids)
    assert len(deltas) == len(ids)  # one piece per token, for APIs streaming token{id,text}


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_concatenate_to_decode(tok, text):
    ids = tok.encode(text)
    rng = random.Random(text)
    for _ in range(30):
        assert "".join(stream(tok, random_chunks(ids, rng))) == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_stream(tok, skip):
    ids = [IM_START, *tok.encode("assistant\n你好😀"), IM_END, *tok.encode("\n尾"), EOT]
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in expected) is not skip
    rng = random.Random(7)
    for _ in range(30):
        assert "".join(stream(tok, random_chunks(ids, rng), skip=skip)) == expected
    assert "".join(stream(tok, [[t] for t in ids], skip=skip)) == expected


def test_random_token_ids_including_invalid_utf8(tok):
    # A random-weight model emits arbitrary ids, so byte sequences can be invalid UTF-8 mid-text.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(151643) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            got = "".join(stream(tok, random_chunks(ids, rng), skip=skip))
            assert got == tok.decode(ids, skip_special_tokens=skip)


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("<|im_start|>user\n说中文<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("好的，没问题 👍")
    for skip in (True, False):
        assert "".join(stream(tok, [[t] for t in ids], skip, prompt)) == tok.decode(ids)
    # A prompt ending mid-character is dropped as context rather than corrupting the output.
    partial = [t for t in tok.encode("龘") if "\ufffd" in tok.decode([t])]
    assert "".join(stream(tok, [[t] for t in ids], True, partial[:1])) == tok.decode(ids)


def test_flush_releases_incomplete_character(tok):
    ids = tok.encode("龘")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])
    assert detok.flush() == ""


def test_window_stays_small(tok):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("中文和English混合的长文本。" * 40)
    detok = IncrementalDetokenizer(Counting())
    for t in ids:
        detok.push_one(t)
    assert detok.text + detok.flush() == tok.decode(ids)
    assert max(calls) <= 8  # never the whole output


def test_a_fast_tokenizer_decodes_through_its_rust_tokenizer(tok):
    """The hot path skips transformers' decode wrapper where it returns the same text, and
    keeps it where it would not (a tokenizer that cleans up spaces, or its own decode)."""
    from serve_app.tokenizer.detokenizer import _rust_backend

    assert _rust_backend(tok) is tok._tokenizer
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 30) for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            assert tok._tokenizer.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )
    tok.clean_up_tokenization_spaces = True
    try:
        assert _rust_backend(tok) is None
        assert IncrementalDetokenizer(tok)._stream is None  # no Rust stream either
    finally:
        tok.clean_up_tokenization_spaces = False

    class OwnDecode(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "x"

    wrapped = object.__new__(OwnDecode)
    wrapped.__dict__.update(tok.__dict__)
    assert _rust_backend(wrapped) is None


def python_path(tok, prompt, skip: bool) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    detok._stream = None
    return detok


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_gives_the_python_paths_deltas_token_by_token(tok, skip):
    """tokenizers' DecodeStream holds back and releases exactly where the two decodes of the
    Python path do: random ids (invalid UTF-8 included), special tokens, prompt context."""
    rng = random.Random(7)
    specials = [IM_START, IM_END, EOT]
    for _ in range(150):
        pick = lambda: rng.choice(specials) if rng.random() < 0.05 else rng.randrange(151643)  # noqa: E731
        prompt = [pick() for _ in range(rng.randrange(0, 10))]
        rust = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert rust._stream is not None
        slow = python_path(tok, prompt, skip)
        for token_id in [pick() for _ in range(60)]:
            assert rust.push_one(token_id) == slow.push_one(token_id)
        assert rust.flush() == slow.flush()
        assert rust.text == slow.text


def test_a_refused_window_goes_on_through_the_python_path_from_the_same_place(tok):
    ids = tok.encode(TEXTS[1] + TEXTS[0], add_special_tokens=False)
    expected = tok.decode(ids)

    class Refusing:
        def __init__(self, inner, after: int) -> None:
            self.inner, self.after = inner, after

        def step(self, backend, token_id):
            self.after -= 1
            if self.after < 0:
                raise Exception("InvalidPrefix")  # what the Rust side raises
            return self.inner.step(backend, token_id)

    for after in (0, 1, 5, len(ids) // 2):
        detok = IncrementalDetokenizer(tok)
        detok._stream = Refusing(detok._stream, after)
        deltas = [detok.push_one(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == expected and detok._stream is None
