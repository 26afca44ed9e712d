"""Hypothesis on the protocol models: whatever JSON a client sends, each family's request model
either refuses it with an `APIError` naming a parameter, or accepts it and then turns it into a
tokenizer request and a replica request, refusing only with `APIError` (never another
exception, which would be a 500)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from serve_app.messages import TokenizedPrompt
from serve_app.protocol import (
    databricks_chat,
    databricks_completions,
    embeddings,
    mindie,
    openai_chat,
    openai_completions,
    responses,
    triton,
)
from serve_app.protocol.defaults import ServerDefaults
from serve_app.protocol.errors import APIError, from_validation_errors
from serve_app.tokenizer.limits import TokenLimits

DEFAULTS = {
    pd: ServerDefaults(TokenLimits(max_seq_len=512, max_input_token_len=256, max_iter_times=64), pd)
    for pd in (False, True)
}
PROMPT = TokenizedPrompt(prompt_token_ids=[1, 2, 3], num_prompt_tokens=3)

MODELS = [
    mindie.InferRequest, mindie.InferTokenRequest, openai_chat.ChatCompletionRequest,
    openai_completions.CompletionRequest, triton.GenerateRequest,
    databricks_chat.DatabricksChatRequest, databricks_completions.DatabricksCompletionRequest,
    responses.ResponsesRequest, embeddings.EmbeddingRequest,
]  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["user", "assistant", "system", "tool", "text", "function", "auto", "none",
                     "required", "json_object", "json_schema", "demo", "hi", "\ud800"]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(
                [
                    "role",
                    "content",
                    "type",
                    "text",
                    "name",
                    "arguments",
                    "id",
                    "function",
                    "parameters",
                    "json_schema",
                    "schema",
                    "call_id",
                    "max_new_tokens",
                    "temperature",
                    "details",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        ),  # fmt: skip
    ),
    max_leaves=12,
)


def bodies(model) -> st.SearchStrategy[dict]:
    """Dicts over the model's own field names (and one unknown), with any JSON values; the
    fixed fields a request needs to get past its first checks are sometimes filled in."""
    keys = st.sampled_from([*model.model_fields, "unknown_field"])
    base = st.sampled_from([{}, {"model": "demo"}, {"model": "demo", "inputs": "hi"},
                            {"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
                            {"model": "demo", "prompt": "hi"}, {"input": "hi"},
                            {"text_input": "hi"}, {"input_id": [1, 2]}])  # fmt: skip
    extra = st.dictionaries(keys, json_values, max_size=5)
    return st.tuples(base, extra).map(lambda pair: {**pair[0], **pair[1]})


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_any_json_is_refused_by_name_or_becomes_requests(model):
    @given(body=bodies(model))
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def run(body):
        try:
            request = model.model_validate(body)
        except ValidationError as exc:
            error = from_validation_errors(exc.errors())
            assert error.message and error.status("openai") == 400
            return
        for pd_mode, defaults in DEFAULTS.items():
            try:
                request.check(pd_mode) if hasattr(request, "check") else None
                if hasattr(request, "tokenize_request"):
                    request.tokenize_request("demo")
                if hasattr(request, "replica_request"):
                    request.replica_request("r", PROMPT, defaults)
            except APIError as exc:
                assert exc.message

    run()
