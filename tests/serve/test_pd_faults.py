"""Faults under prefill/decode disaggregation, over real HTTP on the Ray cluster: the decode
replica killed mid-stream ends the stream with an error within seconds and is replaced; the
prefill replica killed once it has handed over does not lose the stream (the decode side has,
or recomputes, the prompt's KV). The surviving replica's KV pool goes back to idle. Slow."""

from __future__ import annotations

import copy
import json
import time

import httpx
import pytest
from serve_helpers import PD_ARGS, deploy
from test_faults import ERROR_WITHIN_S, LONG, _actors, _kill, _serves_again, _stream_until_fault

pytestmark = pytest.mark.slow

ARGS = copy.deepcopy(PD_ARGS)
ARGS["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 8192
ARGS["BackendConfig"]["ScheduleConfig"].update(maxIterTimes=4096, kvCacheBlocks=1024)


@pytest.fixture(scope="module")
def pd_app(cluster):
    from ray import serve

    yield deploy(cluster, ARGS)
    serve.delete("serve_app")


def _idle(deployment: str, timeout_s: float = 10.0) -> dict:
    """The (single) replica's engine stats once nothing runs and every KV block is free."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, "serve_app")
    deadline = time.monotonic() + timeout_s
    while True:
        stats = handle.stats.remote().result()
        if not stats["num_running"] and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        assert time.monotonic() < deadline, f"{deployment} not idle: {stats}"
        time.sleep(0.2)


def test_a_decode_replica_killed_mid_stream_ends_it_and_is_replaced(pd_app):
    (decode,) = _actors("DecodeReplica")
    # the first event is the prefill replica's token; the second comes from the decode replica
    events, ended_s = _stream_until_fault(pd_app, lambda: _kill(decode), after=2)
    assert ended_s < ERROR_WITHIN_S
    assert "a replica serving the request failed" in events[-1]["error"]["message"]
    _idle("PrefillReplica")  # the prefill side holds nothing of the request
    _serves_again(pd_app)
    assert [a["name"] for a in _actors("DecodeReplica")] != [decode["name"]]


def test_a_prefill_replica_killed_after_the_hand_off_does_not_lose_the_stream(pd_app):
    _serves_again(pd_app)
    (prefill,) = _actors("PrefillReplica")
    body = {**LONG, "max_tokens": 300}
    with httpx.Client(base_url=pd_app, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        _kill(prefill)  # the first token is out: the decode replica has it
    assert "error" not in events[-1], events[-1]
    assert events[-1]["usage"]["completion_tokens"] == 300
    _idle("DecodeReplica")
    _serves_again(pd_app)
    assert [a["name"] for a in _actors("PrefillReplica")] != [prefill["name"]]
