"""RayBackend without a cluster: fake deployment handles stand in for Ray Serve's."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError, ActorUnavailableError

from serve_app.ingress.backend import RayBackend
from serve_app.messages import ErrorKind, Rejection, TokenizedPrompt, TokenizeRequest

PROMPT = TokenizedPrompt(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3)


class FlakyPool:
    """A tokenizer pool handle whose first `failures` calls meet a dead replica."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0
        self.tokenize = self  # handle.tokenize.remote(req)

    def remote(self, req):
        self.calls += 1

        async def answer():
            if self.calls <= self.failures:
                if self.calls == 1:
                    raise ActorDiedError()
                raise ActorUnavailableError("the replica is restarting", None)
            return PROMPT

        return answer()


def _tokenize(pool: FlakyPool):
    backend = RayBackend(pool, {})
    return asyncio.run(backend.tokenize(TokenizeRequest(model="demo", kind="text", text="hi")))


def test_a_dead_tokenizer_replica_is_retried_once_on_another():
    pool = FlakyPool(failures=1)
    assert _tokenize(pool) == PROMPT and pool.calls == 2


def test_two_dead_replicas_in_a_row_are_an_unavailable_refusal():
    pool = FlakyPool(failures=2)
    refused = _tokenize(pool)
    assert isinstance(refused, Rejection) and refused.kind == ErrorKind.UNAVAILABLE
    assert "no tokenizer pool replica" in refused.message and pool.calls == 2


class Handle:
    """A deployment handle that records the options it was re-made with."""

    def __init__(self, name: str, options: dict | None = None) -> None:
        self.name, self.opts = name, options or {}

    def options(self, **kwargs):
        return Handle(self.name, {**self.opts, **kwargs})


def test_the_ingress_sends_its_calls_over_grpc_except_the_pd_ones(monkeypatch):
    from ray import serve

    from serve_app.config import load_config
    from serve_app.ingress import deployment

    monkeypatch.setattr(deployment, "bind_process", lambda cores: None)  # not this test process
    monkeypatch.setattr(deployment, "_token_inbox", lambda config: None)
    context = type("Context", (), {"app_name": "serve_app"})
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    roles = {
        "colocated": {"demo": Handle("replica")},
        "prefill": {"demo": Handle("prefill")},
        "decode": {"demo": Handle("decode")},
    }
    ingress = deployment.Ingress(
        Handle("pool"), roles, load_config({}), [], {"emb": Handle("emb")}, Handle("stops")
    )
    backend = ingress.backend
    grpc = {"_by_reference": False}
    assert backend.tokenizer_pool.opts == grpc and backend.replicas["demo"].opts == grpc
    assert backend.embedding_replicas["emb"].opts == grpc and backend.stop_registry.opts == grpc
    # their messages carry the KV's ObjectRef: Ray's own serialization
    assert backend.prefill_replicas["demo"].opts == {} == backend.decode_replicas["demo"].opts
