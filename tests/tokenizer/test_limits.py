"""Token-count rules (serve_app/tokenizer/limits.py): every boundary, table-driven."""

from __future__ import annotations

import pytest

from serve_app.config import load_config
from serve_app.tokenizer.limits import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_TOKEN_ID,
    TokenLimitError,
    TokenLimits,
)


def limits(
    seq=2560, inp=2048, it=512, trunc=False, mpe: int | None = 32768, vocab: int | None = 151936
) -> TokenLimits:
    return TokenLimits(seq, inp, it, trunc, mpe, vocab)


def test_built_from_the_app_config():
    deploy = {"maxSeqLen": 100, "maxInputTokenLen": 80, "truncation": True}
    sched = {"maxIterTimes": 30, "maxPrefillTokens": 80}
    cfg = load_config({"BackendConfig": {"ModelDeployConfig": deploy, "ScheduleConfig": sched}})
    got = TokenLimits.of(cfg, max_position_embeddings=64, vocab_size=1000)
    assert got == TokenLimits(100, 80, 30, True, 64, 1000)
    assert DEFAULT_MAX_NEW_TOKENS == 20 and got.default_max_tokens == 30


@pytest.mark.parametrize(
    "lim, expected",
    [
        (limits(), 2048),  # maxInputTokenLen binds
        (limits(seq=1000), 999),  # maxSeqLen - 1 binds
        (limits(mpe=512), 512),  # max_position_embeddings binds
        (limits(mpe=None), 2048),  # no max_position_embeddings: no bound from it
        (limits(seq=4_000_000, inp=4_000_000, it=1, mpe=None), 1 << 20),  # the 1MB cap
    ],
)
def test_completion_prompt_limit(lim, expected):
    assert lim.completion_prompt_limit == expected
    assert lim.check_completion_prompt([7] * expected) == [7] * expected
    with pytest.raises(TokenLimitError) as err:
        lim.check_completion_prompt([7] * (expected + 1))
    e = err.value
    assert (e.param, e.limit, e.actual) == ("prompt", expected, expected + 1)
    assert "prompt" in str(e) and f"between 1 and {expected}" in str(e)
    assert "maxInputTokenLen" in str(e)


@pytest.mark.parametrize(
    "lim, expected",
    [
        (limits(), 2048),  # 2560 - 512
        (limits(mpe=1000), 1000),
        (limits(mpe=None, it=1), 2559),
    ],
)
def test_chat_prompt_limit(lim, expected):
    assert lim.chat_prompt_limit == expected
    assert len(lim.check_chat_prompt([1] * expected)) == expected
    with pytest.raises(TokenLimitError) as err:
        lim.check_chat_prompt([1] * (expected + 1))
    assert (err.value.param, err.value.limit) == ("messages", expected)
    assert "messages" in str(err.value) and "maxSeqLen - maxIterTimes" in str(err.value)


@pytest.mark.parametrize("method", ["check_completion_prompt", "check_chat_prompt"])
def test_truncation_keeps_the_tail(method):
    lim = limits(seq=20, inp=10, it=10, trunc=True)  # both limits are 10
    ids = list(range(15))
    assert getattr(lim, method)(ids) == list(range(5, 15))
    assert getattr(lim, method)(ids[:10]) == ids[:10]  # at the limit: untouched
    with pytest.raises(TokenLimitError):  # truncation off: refused
        getattr(limits(seq=20, inp=10, it=10), method)(ids)


@pytest.mark.parametrize("trunc", [False, True])
def test_empty_or_impossible_prompt_refused_even_with_truncation(trunc):
    with pytest.raises(TokenLimitError, match="prompt"):
        limits(trunc=trunc).check_completion_prompt([])
    lim = limits(seq=512, inp=511, it=512, trunc=trunc)  # chat limit 0
    with pytest.raises(TokenLimitError) as err:
        lim.check_chat_prompt([1])
    assert err.value.limit == 0


@pytest.mark.parametrize(
    "vocab, ids, ok",
    [
        (1000, [0, 1, 999], True),  # 0 and 1 accepted despite the documented "(1, ..."
        (1000, [5, 1000], False),  # vocabulary binds
        (1000, [-1], False),
        (None, [MAX_TOKEN_ID], True),  # no vocab_size: the documented range only
        (0, [MAX_TOKEN_ID + 1], False),
        (10 * MAX_TOKEN_ID, [MAX_TOKEN_ID + 1], False),  # range binds for a huge vocab
        (1000, [True], False),
        (1000, [1.0], False),
    ],
)
def test_token_ids(vocab, ids, ok):
    lim = limits(vocab=vocab)
    if ok:
        assert lim.check_token_ids(ids) == ids
        return
    with pytest.raises(TokenLimitError) as err:
        lim.check_token_ids(ids)
    high = min(vocab - 1, MAX_TOKEN_ID) if vocab else MAX_TOKEN_ID
    assert (err.value.param, err.value.low, err.value.limit) == ("input_id", 0, high)
    assert f"input_id[{len(ids) - 1}]" in str(err.value) and f"[0, {high}]" in str(err.value)


def test_token_ids_length_uses_completion_limit():
    lim = limits(inp=4)
    assert lim.check_token_ids([1, 2, 3, 4]) == [1, 2, 3, 4]
    with pytest.raises(TokenLimitError) as err:
        lim.check_token_ids([1, 2, 3, 4, 5])
    assert (err.value.param, err.value.limit, err.value.actual) == ("input_id", 4, 5)
    assert limits(inp=4, trunc=True).check_token_ids([1, 2, 3, 4, 5]) == [2, 3, 4, 5]


@pytest.mark.parametrize(
    "max_tokens, expected",
    [(None, 512), (1, 1), (511, 511), (512, 512), (513, 512), (2**31 - 1, 512)],
)
def test_max_output_tokens(max_tokens, expected):
    assert limits().max_output_tokens(max_tokens) == expected


@pytest.mark.parametrize(
    "prompt_len, max_tokens, expected",
    [(100, None, 512), (2100, None, 460), (2100, 20, 20), (2560, None, 0), (2559, 5, 1)],
)
def test_output_budget(prompt_len, max_tokens, expected):
    assert limits().output_budget(prompt_len, max_tokens) == expected


@pytest.mark.parametrize(
    "max_tokens, total",
    [(None, 513), (512, 513), (1000, 513), (511, 511), (20, 20), (1, 1)],
)
def test_pd_totals(max_tokens, total):
    lim = limits()
    assert lim.pd_total_tokens(max_tokens) == total
    assert lim.pd_decode_tokens(max_tokens) == total - 1
