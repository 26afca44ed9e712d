"""EmbeddingReplica as a plain object (no Ray): concurrent requests share forward passes and
each gets its own vectors back, in order; a refused input refuses its own request only; the
pipeline turns refusals and unknown endpoints into API errors."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import load_config
from serve_app.messages import EmbedRequest, EmbedResult, ErrorKind, Rejection
from serve_app.replica.embedding_replica import EmbeddingReplica

ENDPOINT = "all-minilm-l6-v2"
REQUESTS = [
    ["A man is eating food."],
    ["A man is eating a piece of bread.", "The stock market fell sharply today."],
    ["Ok", "A woman is playing the violin.", "A girl plays a string instrument on stage."],
    ["The new phone costs $999 and ships in three to five days."],
    ["one", "two"],
    ["Paris is the capital of France."],
]


@pytest.fixture(scope="module")
def config():
    return load_config({"EmbeddingConfig": [{"endpointName": ENDPOINT, "maxBatchSize": 16}]})


@pytest.fixture(scope="module")
def replica(config):
    return EmbeddingReplica(config, 0)


def close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_concurrent_requests_share_passes_and_get_their_own_vectors(replica):
    async def main():
        return await asyncio.gather(*(replica.embed(EmbedRequest(texts)) for texts in REQUESTS))

    before = asyncio.run(replica.stats())
    results = asyncio.run(main())
    after = asyncio.run(replica.stats())
    # all six were waiting when the first batch formed: their 11 inputs fit one 16-input pass
    assert after["num_batches"] - before["num_batches"] == 1
    assert after["num_requests"] - before["num_requests"] == len(REQUESTS)
    for texts, result in zip(REQUESTS, results, strict=True):
        assert isinstance(result, EmbedResult)
        vectors, counts = replica.encoder.encode(texts)  # each request alone
        assert result.num_tokens == counts
        assert len(result.vectors) == len(texts)
        assert all(close(a, b) for a, b in zip(result.vectors, vectors, strict=True))


def test_a_refused_input_refuses_its_own_request_only(replica):
    longest = " ".join(["hello"] * 255)  # 257 tokens with [CLS] and [SEP]: one too many

    async def main():
        return await asyncio.gather(
            replica.embed(EmbedRequest(["fine"])),
            replica.embed(EmbedRequest(["fine", longest])),
            replica.embed(EmbedRequest(["", "fine"], param="inputs")),
            replica.embed(EmbedRequest(["also fine"])),
        )

    ok, too_long, empty, also_ok = asyncio.run(main())
    assert isinstance(ok, EmbedResult) and isinstance(also_ok, EmbedResult)
    assert isinstance(too_long, Rejection) and too_long.kind == ErrorKind.VALIDATION
    assert too_long.param == "input[1]" and "257 tokens" in too_long.message
    assert "at most 256" in too_long.message  # the model's max_seq_length
    assert isinstance(empty, Rejection) and empty.param == "inputs[0]"


def test_no_texts_is_refused(replica):
    refused = asyncio.run(replica.embed(EmbedRequest([])))
    assert isinstance(refused, Rejection) and refused.param == "input"


def test_stats(replica):
    stats = asyncio.run(replica.stats())
    assert stats["endpoint"] == ENDPOINT and stats["dimensions"] == 384
    assert stats["max_input_tokens"] == 256 and stats["max_batch_size"] == 16


def test_the_pipeline_raises_refusals_and_unknown_endpoints(config, replica):
    from serve_app.ingress.backend import LocalBackend
    from serve_app.ingress.pipeline import Pipeline
    from serve_app.protocol.errors import APIError

    pipeline = Pipeline(config, LocalBackend(None, {}, embedding={ENDPOINT: replica}))
    assert pipeline.embedding_names == [ENDPOINT]
    result = asyncio.run(pipeline.embed(ENDPOINT, EmbedRequest(["hello", "world"])))
    assert len(result.vectors) == 2 and result.num_tokens == [3, 3]
    with pytest.raises(APIError) as error:
        asyncio.run(pipeline.embed(ENDPOINT, EmbedRequest(["hello", "  "])))
    assert error.value.kind == ErrorKind.VALIDATION and error.value.param == "input[1]"
    with pytest.raises(APIError) as error:
        asyncio.run(pipeline.embed("demo", EmbedRequest(["hello"])))
    assert error.value.kind == ErrorKind.NOT_FOUND
    assert "'demo'" in error.value.message and ENDPOINT in error.value.message
