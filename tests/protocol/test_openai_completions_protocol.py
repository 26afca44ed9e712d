"""Completions protocol without a model: the cross-rules, the engine params a request
becomes (n / best_of / beam search), logprobs offsets and usage on the final stream chunk."""

from __future__ import annotations

import pytest

from serve_app.messages import (
    ChoiceDelta,
    ReplicaChunk,
    StepInfo,
    TokenizedPrompt,
    TokenLogprobText,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError
from serve_app.protocol.openai_completions import (
    CompletionRequest,
    CompletionStream,
    completion_logprobs,
    completion_response,
)
from serve_app.tokenizer.limits import TokenLimits

LIMITS = TokenLimits(max_seq_len=512, max_input_token_len=256, max_iter_times=64)
DEFAULTS = ServerDefaults(LIMITS)
PROMPT = TokenizedPrompt([1, 2, 3], 3)


def parse(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "demo", "prompt": "hi", **fields})


# (fields, the parameter named) for every cross-rule (docs/apis.md#openai-completions)
CROSS_RULES = [
    ({"use_beam_search": True, "stop": "x"}, "stop"),
    ({"use_beam_search": True, "stop": ["x"], "stream": True}, "stop"),
    ({"n": 2, "temperature": 0}, "temperature"),
    ({"best_of": 2, "temperature": 0.0}, "temperature"),
    ({"use_beam_search": True, "n": 2, "temperature": 0}, "temperature"),  # n's rule stays
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"stream": True, "best_of": 2}, "best_of"),
    ({"stream": True, "best_of": 1}, "best_of"),
    ({"stream": True, "n": 2, "best_of": 3}, "best_of"),
    ({"stream": True, "n": 3, "best_of": 2}, "best_of"),
]
ALLOWED = [
    {"n": 2, "best_of": 4},
    {"best_of": 3},
    {"n": 2, "temperature": 0.5},
    {"stream": True, "n": 2, "best_of": 2},
    {"stream": True, "n": 2},
    {"use_beam_search": True, "n": 2, "best_of": 1, "temperature": 0.7},
    {"use_beam_search": True, "best_of": 3, "temperature": 0},  # best_of is not checked
    {"use_beam_search": True, "stream": True, "best_of": 5},
    {"use_beam_search": True, "stop": []},  # an empty list is null
]


@pytest.mark.parametrize("fields, param", CROSS_RULES)
def test_cross_rules(fields, param):
    with pytest.raises(APIError) as info:
        parse(**fields).check(pd_mode=False)
    assert info.value.kind == "validation" and info.value.param == param
    assert info.value.message.startswith(param)


@pytest.mark.parametrize("fields", ALLOWED)
def test_allowed_combinations(fields):
    parse(**fields).check(pd_mode=False)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stop": "x"}, "stop"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logprobs": 0}, "logprobs"),
    ],
)
def test_pd_mode_refusals(fields, param):
    with pytest.raises(APIError) as info:
        parse(**fields).check(pd_mode=True)
    assert (info.value.kind, info.value.param) == ("unsupported", param)


def test_stop_limits_and_normalisation():
    assert parse(stop="x" * 32768).stop == ["x" * 32768]
    assert parse(stop=["a" * 16384, "b" * 16384]).stop == ["a" * 16384, "b" * 16384]
    assert parse(stop=[]).stop is None


def test_params_for_sampling_best_of_and_beam_search():
    req = parse().replica_request("r", PROMPT, DEFAULTS)
    p = req.params
    assert (p.n, p.best_of, p.temperature, p.top_p, p.max_tokens) == (1, 1, 1.0, 1.0, 64)
    assert req.stream is False and not req.logprob_texts and p.logprobs is None
    p = parse(n=2, best_of=4).replica_request("r", PROMPT, DEFAULTS).params
    assert (p.n, p.best_of, p.use_beam_search) == (2, 4, False)
    req = parse(use_beam_search=True, n=2, best_of=1, stream=True, logprobs=2).replica_request(
        "r", PROMPT, DEFAULTS
    )
    p = req.params
    assert (p.n, p.best_of, p.use_beam_search, p.logprobs) == (2, 2, True, 2)
    assert req.stream is False  # the fake stream: one final chunk
    assert req.logprob_texts and req.token_texts
    req = parse(
        temperature=0, top_k=5, top_p=0.5, seed=1, max_tokens=2**31 - 1, stop=["x"],
        stop_token_ids=[3, 2**31, -5], include_stop_str_in_output=True, ignore_eos=True,
        skip_special_tokens=False, priority=2, stream=True, repetition_penalty=0.5,
    ).replica_request("r", PROMPT, DEFAULTS)  # fmt: skip
    p = req.params
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (0.0, 5, 0.5, 1, 64)
    assert p.stop_token_ids == [3] and p.ignore_eos and p.repetition_penalty == 0.5
    assert req.stop == ["x"] and req.include_stop_str_in_output and req.stream
    assert req.priority == 2 and not req.skip_special_tokens


def test_token_id_prompt_is_tokenized_as_token_ids():
    tok = parse(prompt=[1, 2]).tokenize_request("demo")
    assert (tok.kind, tok.token_ids, tok.param) == ("token_ids", [1, 2], "prompt")
    tok = parse().tokenize_request("demo")
    assert (tok.kind, tok.text) == ("completion", "hi")


def _lp(token_id, text, logprob, top=()):
    return TokenLogprobText(token_id, logprob, text, list(top))


def _delta(index, texts, finish=None, stop_reason=None, logprobs=True) -> ChoiceDelta:
    lps = [_lp(i, t, -1.0 - i, [(9, "z", -0.1), (i, t, -1.0 - i)]) for i, t in enumerate(texts)]
    return ChoiceDelta(
        index=index, token_ids=list(range(len(texts))), text="".join(texts),
        token_texts=list(texts), logprobs=lps if logprobs else [], finish_reason=finish,
        stop_reason=stop_reason, num_output_tokens=len(texts),
    )  # fmt: skip


def test_logprobs_shape_top_has_the_chosen_token_first():
    out = completion_logprobs(_delta(0, ["?", " who"]), offset=0)
    assert out == {
        "text_offset": [0, 1],
        "token_logprobs": [-1.0, -2.0],
        "tokens": ["?", " who"],
        "top_logprobs": [{"?": -1.0, "z": -0.1}, {" who": -2.0, "z": -0.1}],
    }
    assert list(out["top_logprobs"][0]) == ["?", "z"]
    # no logprob from the engine for a token: null entries, tokens still listed
    missing = completion_logprobs(_delta(0, ["a", "bc"], logprobs=False), offset=4)
    assert missing["text_offset"] == [4, 5] and missing["token_logprobs"] == [None, None]


def test_response_shape_with_offsets_running_across_choices():
    chunk = ReplicaChunk(
        "r",
        choices=[
            _delta(0, ["\n", "I", " am"], "length"),
            _delta(1, [" to", "x"], "stop_string", "x"),
        ],
        steps=[StepInfo(2, 5496.4), StepInfo(2, 146.0), StepInfo(1, 65.6)],
        finished=True,
    )  # fmt: skip
    body = completion_response("cmpl-1", 5, "demo", chunk, 3, want_logprobs=True)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion"
    first, second = body["choices"]
    assert list(first) == ["index", "text", "logprobs", "stop_reason", "finish_reason"]
    assert (first["text"], first["stop_reason"], first["finish_reason"]) == (
        "\nI am",
        None,
        "length",
    )
    assert (second["stop_reason"], second["finish_reason"]) == ("x", "stop")
    assert first["logprobs"]["text_offset"] == [0, 1, 2]
    assert second["logprobs"]["text_offset"] == [5, 8]  # after choice 0's 5 characters
    assert body["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
        "batch_size": [2, 2, 1], "queue_wait_time": [5496, 146, 66],
    }  # fmt: skip
    assert completion_response("c", 5, "d", chunk, 3, False)["choices"][0]["logprobs"] is None


def test_stream_events_per_choice_with_usage_on_the_last_one():
    stream = CompletionStream("c", 5, "demo", 3, want_logprobs=True)
    first = stream.events(ReplicaChunk("c", choices=[_delta(0, ["ab"]), _delta(1, ["x"])],
                                       steps=[StepInfo(2, 10.0)]))  # fmt: skip
    assert [e["choices"][0]["index"] for e in first] == [0, 1]
    assert all("usage" not in e and e["choices"][0]["finish_reason"] is None for e in first)
    tail = _delta(0, ["cd"], "stop_token", 7)
    tail.num_output_tokens = 2
    last = stream.events(
        ReplicaChunk("c", choices=[tail], steps=[StepInfo(1, 20.0)], finished=True)
    )
    assert last[-1]["choices"][0]["logprobs"]["text_offset"] == [2]  # within choice 0's text
    assert (last[-1]["choices"][0]["finish_reason"], last[-1]["choices"][0]["stop_reason"]) == (
        "stop", 7,
    )  # fmt: skip
    assert last[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
        "batch_size": [2, 1], "queue_wait_time": [10, 20],
    }  # fmt: skip


def test_stream_final_chunk_without_choices_still_carries_usage():
    stream = CompletionStream("c", 5, "demo", 3, want_logprobs=False)
    (event,) = stream.events(ReplicaChunk("c", finished=True))
    assert event["choices"] == [] and event["usage"]["total_tokens"] == 3
