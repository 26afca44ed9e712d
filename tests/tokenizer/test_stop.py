"""StopMatcher: vLLM stop-string semantics over text deltas, alone and after the detokenizer."""

from __future__ import annotations

import random

import pytest

from serve_app.models.demo import ensure_demo_model
from serve_app.models.loader import load_tokenizer
from serve_app.tokenizer.detokenizer import IncrementalDetokenizer
from serve_app.tokenizer.stop import StopMatcher, apply_stop


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_demo_model("demo-tiny"))


def run(deltas: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str | None]:
    """Streams deltas; returns what a client saw (flush included) and the match."""
    matcher = StopMatcher(stop, include)
    seen, matched = [], None
    for d in deltas:
        out, matched = matcher.push(d)
        seen.append(out)
    seen.append(matcher.flush())
    assert matched == matcher.matched
    return seen, matched


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


CASES = [
    # text, stop, include, expected output, expected match
    ("Hello world. Bye", ["."], False, "Hello world", "."),
    ("Hello world. Bye", ["."], True, "Hello world.", "."),
    ("答案是42。结束了", ["结束"], False, "答案是42。", "结束"),
    ("a STOP b END c", ["END", "STOP"], False, "a ", "STOP"),  # earliest occurrence wins
    ("a STOP b END c", ["END", "STOP"], True, "a STOP", "STOP"),
    ("xxabcx", ["ab", "abc"], True, "xxab", "ab"),  # a prefix of another completes first
    ("xxabcx", ["abc", "bc"], True, "xxabc", "abc"),  # same end: the longer one
    ("abcd", ["abcd", "c"], False, "ab", "c"),  # the first one completed wins
    ("no stop here", ["STOP"], False, "no stop here", None),
    ("ends with ST", ["STOP"], False, "ends with ST", None),  # held back, released at flush
    ("plain", [], False, "plain", None),
    ("empty stop", [""], False, "empty stop", None),
]


@pytest.mark.parametrize(("text", "stop", "include", "want", "match"), CASES)
def test_any_split_gives_the_same_result(text, stop, include, want, match):
    assert apply_stop(text, stop, include) == (want, match)
    rng = random.Random(text)
    for _ in range(50):
        seen, matched = run(splits(text, rng), stop, include)
        assert ("".join(seen), matched) == (want, match)
    seen, matched = run(list(text), stop, include)
    assert ("".join(seen), matched) == (want, match)


def test_holds_back_possible_prefix_then_releases():
    m = StopMatcher(["</answer>"])
    assert m.push("42 </ans") == ("42 ", None)
    assert m.push("wer is") == ("</answer is", None)  # turned out not to be the stop string
    assert m.push(" <") == (" ", None)
    assert m.flush() == "<"


def test_no_hold_back_without_stop_strings():
    m = StopMatcher([])
    assert m.push("</ans") == ("</ans", None)
    assert m.flush() == ""


def test_after_match_nothing_more():
    m = StopMatcher(["\n\n"], include_stop_str_in_output=True)
    assert m.push("para\n") == ("para", None)
    assert m.push("\nmore") == ("\n\n", "\n\n")
    assert m.push("ignored") == ("", "\n\n")
    assert m.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "先说结论：好的。然后是代码 def f(): pass"
    stop = "结论：好"
    ids = tok.encode(text)
    # The stop string must really span tokens (and split characters) for this to mean anything.
    assert not any(stop in tok.decode([t]) for t in ids)
    want = text[: text.index(stop) + (len(stop) if include else 0)]
    rng = random.Random(1)
    for _ in range(20):
        detok, matcher = IncrementalDetokenizer(tok), StopMatcher([stop, "def"], include)
        seen, i = [], 0
        while i < len(ids) and matcher.matched is None:
            n = rng.randint(1, 3)
            out, _ = matcher.push(detok.push(ids[i : i + n]))
            seen.append(out)
            i += n
        seen.append(matcher.push(detok.flush())[0] + matcher.flush())
        assert "".join(seen) == want
        assert matcher.matched == stop
