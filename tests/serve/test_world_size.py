"""worldSize over Ray: a model split over two or three ranks (the replica and rank actors in the
replica's placement group) answers every API family as the same model on one rank does, greedy
tokens and log-probabilities alike; a rank killed or hung mid-stream ends the stream with an
error, and Ray Serve replaces the replica with all its ranks; in PD mode the prefill and the
decode are each split over two. Slow."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time

import httpx
import pytest
from serve_helpers import (
    BACK_WITHIN_S,
    ERROR_WITHIN_S,
    MODELS_ARGS,
    SMOLLM2,
    SMOLLM2_SPLIT,
    actors,
    deploy,
    kv_idle,
    serves_again,
    stream_until_fault,
)

ARGS = MODELS_ARGS  # "demo" over two ranks and SmolLM2 over three, each next to itself on one


@pytest.fixture(scope="module")
def server(cluster):
    from ray import serve

    yield deploy(cluster, ARGS)
    serve.delete("serve_app")


def _rank_actors(model: str | None = None) -> list[tuple[str, int]]:
    """(actor id, pid) of each live rank actor, or of those `model`'s replicas started (from
    the GCS: the test cluster has no dashboard for Ray's state API)."""
    from ray._private import state

    alive = {k: v for k, v in state.actors().items() if v["State"] == "ALIVE"}

    def where(address: dict) -> tuple:
        return address["IPAddress"], address["Port"]

    owners = {where(info["Address"]) for info in alive.values()
              if info["ActorClassName"].endswith(f":ModelReplica-{model}")}  # fmt: skip
    return [
        (actor_id, info["Pid"]) for actor_id, info in alive.items()
        if info["ActorClassName"] == "Rank"
        and (model is None or where(info["OwnerAddress"]) in owners)
    ]  # fmt: skip


def _answers(http, model: str) -> dict:
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    chat = http.post("/v1/chat/completions", json={  # greedy: top_k 1 (temperature > 0 here)
        "model": model, "messages": [{"role": "user", "content": "hello there"}],
        "logprobs": True, "top_logprobs": 1, "top_k": 1, "max_tokens": 8,
    })  # fmt: skip
    completion = http.post("/v1/completions", json={"model": model, "prompt": "a b c", **greedy})
    triton = http.post(f"/v2/models/{model}/generate", json={
        "text_input": "once upon", "parameters": {"max_new_tokens": 8, "do_sample": False},
    })  # fmt: skip
    mindie = http.post("/infer", json={
        "inputs": "tell me", "model": model, "stream": False,
        "parameters": {"max_new_tokens": 8, "do_sample": False},
    })  # fmt: skip
    for reply in (chat, completion, triton, mindie):
        assert reply.status_code == 200, reply.text
    choice = chat.json()["choices"][0]
    return {
        "chat": choice["message"]["content"],
        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
        "completion": completion.json()["choices"][0]["text"],
        "triton": triton.json()["text_output"],
        "mindie": mindie.json()["generated_text"],
    }


@pytest.mark.parametrize(
    "split, one", [("demo", "one"), (SMOLLM2_SPLIT, SMOLLM2)], ids=["demo-2", "smollm2-3"]
)
def test_a_model_over_several_ranks_answers_as_on_one(http, split, one):
    # each replica is rank 0 of its model; the others are actors: 1 for the demo, 2 for SmolLM2
    assert (len(_rank_actors("demo")), len(_rank_actors(SMOLLM2_SPLIT))) == (1, 2)
    over, on_one = _answers(http, split), _answers(http, one)
    assert {k: v for k, v in over.items() if k != "logprobs"} == {
        k: v for k, v in on_one.items() if k != "logprobs"
    }
    assert over["logprobs"] == pytest.approx(on_one["logprobs"], abs=1e-4)


def test_a_rank_killed_mid_stream_ends_the_stream_and_the_replica_is_replaced(server):
    (rank,) = _rank_actors("demo")
    (replica,) = actors("ModelReplica-demo")
    events, ended_s = stream_until_fault(server, lambda: os.kill(rank[1], signal.SIGKILL))
    assert ended_s < ERROR_WITHIN_S
    assert "worldSize 2" in events[-1]["error"]["message"], events[-1]
    serves_again(server)
    deadline = time.monotonic() + BACK_WITHIN_S
    while [r[0] for r in _rank_actors("demo")] in ([], [rank[0]]):
        assert time.monotonic() < deadline, "no new rank came with the replaced replica"
        time.sleep(1)
    assert [a["name"] for a in actors("ModelReplica-demo")] != [replica["name"]]
    # and /metrics shows the model idle: what the killed replica reported last counts no more
    assert kv_idle(server, 30), "/metrics still counts requests or KV blocks"


def test_a_rank_that_hangs_ends_the_stream_and_the_replica_is_replaced(server):
    """A stopped rank process (as one stuck holding its interpreter) fails no collective: rank 0
    waits in the next one. The health check finds that the rank does not answer, the stream ends
    with why, and Ray Serve replaces the replica with its ranks, the stopped one included."""
    from serve_app.placement import is_alive
    from serve_app.replica.ranks import RANK_ANSWER_S

    serves_again(server)  # after the test before
    (rank,) = _rank_actors("demo")
    try:
        events, ended_s = stream_until_fault(server, lambda: os.kill(rank[1], signal.SIGSTOP))
        assert ended_s < RANK_ANSWER_S + 10  # the health check runs every second here
        assert "rank 1 of worldSize 2 has not answered" in events[-1]["error"]["message"]
        serves_again(server)
        deadline = time.monotonic() + BACK_WITHIN_S
        while [r[0] for r in _rank_actors("demo")] in ([], [rank[0]]) or is_alive(rank[1]):
            assert time.monotonic() < deadline, "the stopped rank is still there"
            time.sleep(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank[1], signal.SIGKILL)


def test_pd_with_the_prefill_and_the_decode_each_over_two_ranks(cluster, http):
    """The hand-off moves every KV head: a prefill split over 2 ranks feeds a decode split over
    2, and the answers are the model's on one device (the app before this one's "one"). PD
    refuses logprobs: the engine tests compare them across world sizes through the hand-off
    (2 to 1 and 1 to 2 there)."""
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    prompts = ["tell me a story about", "a b c d e f"]
    body = {"model": "one", **greedy}
    expected = [http.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
    args = copy.deepcopy(ARGS)
    args["ServerConfig"] = {**args["ServerConfig"], "inferMode": "dmi"}
    (model,) = [m for m in args["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
                if m["modelName"] == "one"]  # fmt: skip
    model.update(modelName="demo", worldSize=2)  # prefill and decode alike
    args["BackendConfig"]["ModelDeployConfig"]["ModelConfig"] = [model]
    # half a core for each rank: the test cluster's nodes have two
    half = {"ray_actor_options": {"num_cpus": 0.5},
            "placement_group_bundles": [{"CPU": 0.5}, {"CPU": 0.5}]}  # fmt: skip
    args["Deployments"] = {**args.get("Deployments", {}), "Prefill": half, "Decode": half}
    url = deploy(cluster, args)
    assert len(_rank_actors()) == 2  # the prefill's rank 1 and the decode's
    with httpx.Client(base_url=url, timeout=60) as client:
        for prompt, want in zip(prompts, expected, strict=True):
            got = client.post("/v1/completions", json={**greedy, "model": "demo", "prompt": prompt})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
