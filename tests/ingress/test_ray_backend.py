"""RayBackend without a cluster: fake deployment handles stand in for Ray Serve's."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorDiedError, ActorUnavailableError

from serve_app.ingress.backend import RayBackend
from serve_app.messages import (
    ErrorKind,
    Rejection,
    ReplicaChunk,
    TokenizedPrompt,
    TokenizeRequest,
)

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


class PoolHandle:
    """A deployment handle on a real TokenizerPool that counts the calls of each method; the
    first `limits_failures` calls of `limits` meet a dead replica."""

    def __init__(self, pool, limits_failures: int = 0) -> None:
        self.pool, self.limits_failures = pool, limits_failures
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        method = getattr(self.pool, name)
        handle = self

        class Method:
            def remote(self, *args):
                handle.calls[name] = handle.calls.get(name, 0) + 1

                async def answer():
                    await asyncio.sleep(0)  # a real call answers on a later turn
                    if name == "limits" and handle.calls[name] <= handle.limits_failures:
                        raise ActorDiedError()
                    result = method(*args)
                    return await result if asyncio.iscoroutine(result) else result

                return answer()

        return Method()


def _demo_pool(truncation: bool = False):
    from serve_app.config import load_config
    from serve_app.tokenizer.pool import TokenizerPool

    model = {"modelName": "demo", "modelWeightPath": "demo-tiny", "dtype": "float32"}
    deploy = {"maxSeqLen": 512, "maxInputTokenLen": 256, "truncation": truncation}
    return TokenizerPool(
        load_config({"BackendConfig": {"ModelDeployConfig": {**deploy, "ModelConfig": [model]}}})
    )


ID_PROMPTS = [
    dict(token_ids=[0, 1, 151642], param="input_id"),
    dict(token_ids=[5, 151936], param="input_id"),  # outside the vocabulary
    dict(token_ids=[5, -1]),
    dict(token_ids=[5, True]),  # a bool is no token id
    dict(token_ids=[]),
    dict(token_ids=list(range(1, 301))),  # over maxInputTokenLen
    dict(token_ids=list(range(1, 301)), truncate=True),  # the request asks to cut it
    dict(token_ids="1 2 3"),  # not a list
]


def test_token_id_prompts_are_checked_in_the_ingress_as_the_pool_checks_them():
    pool = _demo_pool()
    handle = PoolHandle(pool)
    backend = RayBackend(handle, {})

    async def run():
        for fields in ID_PROMPTS:
            req = TokenizeRequest(model="demo", kind="token_ids", **fields)
            assert await backend.tokenize(req) == await pool.tokenize(req), fields
        # a text prompt still needs the pool's tokenizer
        text = TokenizeRequest(model="demo", kind="text", text="hi")
        assert await backend.tokenize(text) == await pool.tokenize(text)

    asyncio.run(run())
    assert handle.calls == {"limits": 1, "tokenize": 1}  # the limits once, then only the text


def test_a_server_that_cuts_prompts_cuts_id_prompts_in_the_ingress_too():
    pool = _demo_pool(truncation=True)
    backend = RayBackend(PoolHandle(pool), {})
    req = TokenizeRequest(model="demo", kind="token_ids", token_ids=list(range(1, 301)))
    out = asyncio.run(backend.tokenize(req))
    assert out.truncated and out.prompt_token_ids == list(range(45, 301))


def test_limits_are_asked_once_for_concurrent_requests_and_again_after_a_failure():
    handle = PoolHandle(_demo_pool(), limits_failures=1)
    backend = RayBackend(handle, {})
    req = TokenizeRequest(model="demo", kind="token_ids", token_ids=[1, 2, 3])

    async def run():
        # the first ask meets a dead replica: the pool checks these prompts itself
        first = await asyncio.gather(*(backend.tokenize(req) for _ in range(4)))
        assert handle.calls == {"limits": 1, "tokenize": 4}
        # the next requests ask again (once for all of them), then no call at all
        later = await asyncio.gather(*(backend.tokenize(req) for _ in range(4)))
        assert handle.calls == {"limits": 2, "tokenize": 4}
        assert await backend.tokenize(req) == first[0] == later[0]
        assert first[0].prompt_token_ids == [1, 2, 3]

    asyncio.run(run())
    assert handle.calls == {"limits": 2, "tokenize": 4}


def test_a_model_the_pool_does_not_serve_gets_the_pools_refusal():
    handle = PoolHandle(_demo_pool())
    req = TokenizeRequest(model="nope", kind="token_ids", token_ids=[1, 2, 3])
    refused = asyncio.run(RayBackend(handle, {}).tokenize(req))
    assert isinstance(refused, Rejection) and refused.kind == ErrorKind.NOT_FOUND
    assert handle.calls == {"limits": 1, "tokenize": 1}


class StreamingHandle:
    """A replica deployment handle: counts how often a handle is re-made (`options`, a method
    looked up); a streaming method's call yields one final chunk naming the method."""

    def __init__(self, counts: dict, options: dict | None = None) -> None:
        self.counts, self.opts = counts, options or {}

    def options(self, **kwargs):
        self.counts["options"] = self.counts.get("options", 0) + 1
        return StreamingHandle(self.counts, {**self.opts, **kwargs})

    def __getattr__(self, name):
        self.counts["lookups"] = self.counts.get("lookups", 0) + 1
        handle = self

        class Method:
            def remote(self, req):
                assert handle.opts == {"stream": True}
                request_id = getattr(req, "request", req).request_id

                async def chunks():
                    yield ReplicaChunk(request_id, [], [], finished=True, replica_id=name)

                return chunks()

        return Method()


def test_streaming_handles_are_made_once_per_model_and_method():
    from serve_app.engine.params import SamplingParams
    from serve_app.messages import DecodeRequest, ReplicaRequest

    counts = {}
    backend = RayBackend(
        PoolHandle(None),
        {"demo": StreamingHandle(counts)},
        decode={"demo": StreamingHandle(counts)},
    )

    async def run():
        seen = []
        for i in range(3):
            req = ReplicaRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=2))
            seen += [c.replica_id async for c in backend.generate("demo", req)]
            decode = DecodeRequest(req, first_token_id=5, transfer=None)
            seen += [c.replica_id async for c in backend.decode("demo", decode)]
        return seen

    assert asyncio.run(run()) == ["generate", "decode"] * 3
    # one streaming handle and one method lookup per (method, model), not per request
    assert counts == {"options": 2, "lookups": 2}
