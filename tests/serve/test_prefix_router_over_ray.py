"""The prefix-aware router inside Ray Serve: a deployment of two light replicas (each answers
which replica it is and reports what it was sent, as a model replica does) routed by it, and a
handle sending conversations whose turns grow: every turn after a conversation's first goes to
the replica its first went to (by chance, 16 turns would all do so once in 65,536 runs); the
calls one request makes are all sent; another handle learns from the replicas' reports."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from serve_app.deployment_options import PREFIX_ROUTER
from serve_app.routing.prefix_index import ROUTING_STATS_KEY, RecentBlocks


@pytest.fixture(scope="module")
def holders(cluster):
    from ray import serve

    @serve.deployment(
        num_replicas=2,
        ray_actor_options={"num_cpus": 0},
        request_router_config={
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"block_size": 4},
            "request_routing_stats_period_s": 0.5,
        },
    )
    class Holder:
        def __init__(self):
            self.name = uuid.uuid4().hex
            self.recent = RecentBlocks(4)

        def generate(self, request) -> str:
            self.recent.add(request.prompt_token_ids)
            return self.name

        def record_routing_stats(self) -> dict:
            return {ROUTING_STATS_KEY: self.recent.snapshot()}

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:  # as an ingress: one request of its own, several calls to the holders
        def __init__(self, holder):
            self.holder = holder

        async def both(self, prompts: list[list[int]]) -> list[str]:
            import asyncio

            calls = [self.holder.generate.remote(SimpleNamespace(prompt_token_ids=p))
                     for p in prompts]  # fmt: skip
            return await asyncio.gather(*calls)

    serve.run(Front.bind(Holder.bind()), name="prefix_routing", route_prefix=None)
    yield serve.get_deployment_handle("Holder", "prefix_routing")
    serve.delete("prefix_routing")


def test_each_conversation_stays_on_the_replica_that_holds_it(holders):
    served: dict[int, list[str]] = {}
    histories = {c: [1000 + c] * 8 for c in range(8)}
    for turn in range(3):
        for c, history in histories.items():
            history += [turn + 1] * 6  # the reply and the next question
            request = SimpleNamespace(prompt_token_ids=list(history))
            served.setdefault(c, []).append(holders.generate.remote(request).result())
    for c, replicas in served.items():
        assert replicas == [replicas[0]] * 3, (c, replicas)


def test_the_calls_of_one_request_are_all_sent(holders):
    """The calls one request makes share Ray Serve's internal request id (a batch's prompts,
    sent by one ingress request): each is routed, none waits forever."""
    from ray import serve

    front = serve.get_app_handle("prefix_routing")
    prompts = [[3000 + i] * 8 for i in range(3)]
    assert len(front.both.remote(prompts).result(timeout_s=60)) == 3


def test_another_ingress_learns_from_the_replicas_what_went_through_this_one(holders):
    """A handle in another process (as another ingress replica) has sent nothing of these
    conversations: it learns where they are from the replicas' routing stats, and sends their
    next turns there."""
    import ray

    @ray.remote(num_cpus=0)
    class OtherIngress:
        def __init__(self):
            from ray import serve

            self.handle = serve.get_deployment_handle("Holder", "prefix_routing")

        def send(self, ids: list[int]) -> str:
            return self.handle.generate.remote(SimpleNamespace(prompt_token_ids=ids)).result()

        def knows(self, ids: list[int]) -> bool:
            """Whether this handle's router has learnt a holder of `ids`' first block (the
            router's own state, read for the test)."""
            from serve_app.routing.prefix_index import block_hashes

            router = self.handle._router._asyncio_router.request_router
            everyone = list(router.curr_replicas)
            return router.index.match(block_hashes(ids, 4)[:1], everyone)[1] == 1

    other = OtherIngress.remote()
    ray.get(other.send.remote([1, 2]))  # its router starts (a prompt under a block: no match)
    histories = {c: [2000 + c] * 12 for c in range(5)}
    first = {c: holders.generate.remote(SimpleNamespace(prompt_token_ids=h)).result()
             for c, h in histories.items()}  # fmt: skip
    deadline = time.monotonic() + 60
    while not all(ray.get([other.knows.remote(h) for h in histories.values()])):
        assert time.monotonic() < deadline, "the replicas' reports never reached the other handle"
        time.sleep(0.5)
    for c, history in histories.items():
        assert ray.get(other.send.remote(history + [7] * 4)) == first[c], c
    ray.kill(other)
