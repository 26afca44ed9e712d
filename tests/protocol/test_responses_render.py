"""The Responses renderer on replies the random demo would never write: calls, held streams."""

from __future__ import annotations

from serve_app.messages import ChoiceDelta, ReplicaChunk
from serve_app.protocol.responses import ResponsesRequest
from serve_app.protocol.responses_render import ResponseBuilder, ResponseStream

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "x", **fields})


def _final(text: str, reason: str = "eos", tokens: int = 7) -> ReplicaChunk:
    delta = ChoiceDelta(0, [1], text, finish_reason=reason, num_output_tokens=tokens)
    return ReplicaChunk("r", [delta], finished=True, num_prompt_tokens=3)


def test_a_call_becomes_a_function_call_item():
    out = ResponseBuilder(_body(tools=[TOOL]), "m", 3).response(_final(f"Sure. {CALL}"))
    message, call = out["output"]
    assert message["content"][0]["text"] == "Sure."
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "get_weather",
        '{"city": "Oslo"}',
    )
    assert call["call_id"].startswith("call_") and out["status"] == "completed"
    assert out["tools"] == [TOOL]  # shown in the Responses shape


def test_parallel_tool_calls_false_keeps_one_call():
    body = _body(tools=[TOOL], parallel_tool_calls=False)
    out = ResponseBuilder(body, "m", 3).response(_final(CALL + CALL))
    assert [item["type"] for item in out["output"]] == ["function_call"]


def test_tools_accept_the_chat_shape_too():
    body = _body(tools=[{"type": "function", "function": {"name": "get_weather"}}],
                 tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert body.tools[0].function.name == "get_weather"
    assert body.tool_choice.function.name == "get_weather"


def test_a_held_stream_sends_the_call_events():
    stream = ResponseStream(ResponseBuilder(_body(tools=[TOOL]), "m", 3))
    first = stream.events(ReplicaChunk("r", [ChoiceDelta(0, [1], CALL[:20])]))
    assert [e["type"] for e in first] == ["response.created", "response.in_progress"]
    rest = stream.events(_final(CALL[20:]))
    assert [e["type"] for e in rest] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert rest[-1]["response"]["output"][0]["name"] == "get_weather"
    assert [e["sequence_number"] for e in first + rest] == list(range(7))
