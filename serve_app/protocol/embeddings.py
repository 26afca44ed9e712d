"""Embeddings (Databricks task llm/v1/embeddings, OpenAI /v1/embeddings): the request with its
rules, its translation to an `EmbedRequest`, and the response (docs/apis.md#embeddings).

`instruction` (Databricks) is put before every input, separated by a space unless it ends in
whitespace; usage counts its tokens. `encoding_format` "base64" (what the openai client asks
for by default) sends each vector as the base64 of its little-endian float32 bytes.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from serve_app.messages import EmbedRequest, EmbedResult
from serve_app.protocol.errors import invalid
from serve_app.protocol.fields import INT32_MAX, Range, RequestModel, StringOrStrings

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
_INPUT_RULE = f"must be a non-empty string or a list of 1 to {MAX_INPUTS} non-empty strings"


Inputs = StringOrStrings(MAX_INPUTS, _INPUT_RULE)


class EmbeddingRequest(RequestModel):
    model: str | None = Field(
        None, description="The embedding endpoint; required except on .../{name}/invocations."
    )
    input: Inputs = Field(description="A string or a list of strings, embedded in one batch.")
    instruction: str | None = Field(None, description="Put before every input (Databricks).")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: Annotated[int | None, Range(0, INT32_MAX, low_open=True)] = Field(
        None, description="Only the model's own size is served (384 for all-MiniLM-L6-v2)."
    )

    def embed_request(self) -> EmbedRequest:
        texts = self.input
        if self.instruction:
            glue = "" if self.instruction[-1].isspace() else " "
            texts = [f"{self.instruction}{glue}{text}" for text in texts]
        return EmbedRequest(texts=texts, param="input")

    def check_dimensions(self, size: int) -> None:
        if self.dimensions is not None and self.dimensions != size:
            raise invalid(
                "dimensions", f"must be {size}, the model's size (it cannot shorten vectors)"
            )


def embedding_response(
    request_id: str, model: str, result: EmbedResult, encoding: str = "float"
) -> dict:
    data = []
    for i, vector in enumerate(result.vectors):
        if encoding == "base64":
            raw = np.asarray(vector, dtype="<f4").tobytes()
            value: Any = base64.b64encode(raw).decode("ascii")
        else:
            value = vector
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(result.num_tokens)
    return {
        "id": request_id,
        "object": "list",
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
