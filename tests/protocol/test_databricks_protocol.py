"""The Databricks request models and the completion renderer, without a server."""

from __future__ import annotations

from serve_app.messages import ChoiceDelta, ReplicaChunk
from serve_app.protocol.databricks_chat import DatabricksChatRequest
from serve_app.protocol.databricks_completions import (
    CompletionRenderer,
    DatabricksCompletionRequest,
)


def _chunk(index: int, text: str, reason: str | None, tokens: int, finished: bool):
    delta = ChoiceDelta(index, [1] * tokens, text, finish_reason=reason, num_output_tokens=tokens)
    return ReplicaChunk("r", [delta], finished=finished, num_prompt_tokens=5)


def test_prompts_split_into_one_request_each_named_for_errors():
    body = DatabricksCompletionRequest.model_validate(
        {"prompt": ["a", "b"], "use_raw_prompt": True}
    )
    one, two = body.per_prompt()
    assert [one.tokenize_request("m").param, two.tokenize_request("m").param] == [
        "prompt[0]", "prompt[1]"
    ]  # fmt: skip
    assert two.tokenize_request("m").text == "b" and two.tokenize_request("m").kind == "completion"
    single = DatabricksCompletionRequest.model_validate(
        {"prompt": "a", "error_behavior": "truncate"}
    )
    req = single.per_prompt()[0].tokenize_request("m")
    assert (req.param, req.kind, req.truncate) == ("prompt", "templated", True)


def test_renderer_numbers_choices_per_prompt_and_applies_echo_and_suffix():
    body = DatabricksCompletionRequest.model_validate(
        {"prompt": ["p0", "p1"], "n": 2, "echo": True, "suffix": "!"}
    )
    render = CompletionRenderer(body, "cmpl-1", 0, "m")
    folded = [
        ReplicaChunk("a", [ChoiceDelta(0, [1], "x", finish_reason="eos", num_output_tokens=1),
                           ChoiceDelta(1, [1], "y", finish_reason="length", num_output_tokens=1)],
                     finished=True, num_prompt_tokens=3),
        ReplicaChunk("b", [ChoiceDelta(0, [1], "z", finish_reason="eos", num_output_tokens=1),
                           ChoiceDelta(1, [1], "w", finish_reason="eos", num_output_tokens=1)],
                     finished=True, num_prompt_tokens=4),
    ]  # fmt: skip
    out = render.response(folded)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "p0x!", "stop"), (1, "p0y!", "length"), (2, "p1z!", "stop"), (3, "p1w!", "stop"),
    ]  # fmt: skip
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_a_timeout_under_truncate_ends_choices_with_length():
    body = DatabricksCompletionRequest.model_validate({"prompt": "p", "stream": True})
    render = CompletionRenderer(body, "cmpl-1", 0, "m")
    assert render.events(0, _chunk(0, "ab", None, 2, False))[0]["choices"][0]["text"] == "ab"
    (end,) = render.timeout_events(0)
    assert end["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert render.timeout_events(0) == []  # it ended already
    whole = CompletionRenderer(body, "cmpl-1", 0, "m").response([_chunk(0, "ab", None, 2, False)])
    assert whole["choices"][0]["finish_reason"] == "length"


def test_tool_call_arguments_reach_the_template_as_objects():
    body = DatabricksChatRequest.model_validate({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ]},
    ]})  # fmt: skip
    message = body.tokenize_request("m").messages[1]
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
