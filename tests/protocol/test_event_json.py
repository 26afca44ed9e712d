"""A stream event's JSON: what json's compact form would say, as UTF-8 bytes, and JSON even
where json's is not (NaN, infinities)."""

from __future__ import annotations

import json
import math

from serve_app.ingress import sse
from serve_app.protocol.event_json import compact_json
from serve_app.protocol.responses_render import sse_event


def json_compact(payload) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def test_an_event_payload_is_json_compact_form_in_utf8():
    payload = {
        "id": "cmpl-1-ab",
        "object": "text_completion",
        "created": 1795890527,
        "choices": [
            {
                "index": 0,
                "text": 'héllo 世界 🙂 "q" \\ \n\t\x01\x7f\u2028',
                "logprobs": {"tokens": ["a"], "token_logprobs": [-0.25], "top_logprobs": None},
                "finish_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "batch_size": [1, 2]},
        "flags": [True, False, None],
        "pairs": (1, 2),
    }
    assert compact_json(payload) == json_compact(payload)


def test_keys_that_are_not_strings_are_written_as_strings():
    assert compact_json({1: "a", 2: {3: 4}}) == json_compact({1: "a", 2: {3: 4}})


def test_floats_read_back_the_same_and_nan_or_infinity_is_null():
    values = [0.1, -0.0, 1e-05, 1e22, -123.456, 2.5e-308, -1.7976931348623157e308]
    assert json.loads(compact_json(values)) == values
    out = compact_json({"a": math.nan, "b": -math.inf, "c": math.inf})
    assert json.loads(out) == {"a": None, "b": None, "c": None}


def test_sse_frames_are_bytes():
    assert sse.event({"x": "é"}) == 'data: {"x":"é"}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"
    frame = sse_event({"type": "response.output_text.delta", "delta": "hi"})
    data = b'{"type":"response.output_text.delta","delta":"hi"}'
    assert frame == b"event: response.output_text.delta\ndata: " + data + b"\n\n"
