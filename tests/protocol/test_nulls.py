"""An explicit null for an optional field means "not given", in every request model of every
family (docs/apis.md#common-rules): clients built from typed models send null for each field
they leave unset. A required field given as null is still refused."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from pydantic import ValidationError

import serve_app.ingress.admin_routes  # noqa: F401 (stopInfer's body)
import serve_app.protocol
from serve_app.protocol.fields import RequestModel

for _module in pkgutil.iter_modules(serve_app.protocol.__path__):
    importlib.import_module(f"serve_app.protocol.{_module.name}")

# The smallest valid body of each request model (its required fields); a new model needs a row.
MINIMAL = {
    "admin_routes.StopInferRequest": {"id": "42"},
    "databricks_common.DatabricksSampling": {},
    "databricks_chat.JsonSchemaFormat": {"name": "x", "schema": {"type": "object"}},
    "openai_completions.CompletionRequest": {"model": "demo", "prompt": "hi"},
    "embeddings.EmbeddingRequest": {"input": "hi"},
    "tool_calls.FunctionDef": {"name": "f"},
    "triton.GenerateRequest": {"text_input": "hi"},
    "triton.GenerateParameters": {},
    "mindie.InferRequest": {"inputs": "hi"},
    "mindie.InferTokenRequest": {"input_id": [1, 2]},
    "mindie.InferParameters": {},
    "responses.TextFormat": {"type": "text"},
    "responses.TextConfig": {},
    "responses.ResponsesRequest": {"input": "hi"},
    "databricks_completions.DatabricksCompletionRequest": {"prompt": "hi"},
    "databricks_chat.DatabricksChatRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "tool_calls.FunctionName": {"name": "f"},
    "databricks_chat.FunctionCall": {"name": "f", "arguments": "{}"},
    "tool_calls.Tool": {"type": "function", "function": {"name": "f"}},
    "tool_calls.NamedToolChoice": {"type": "function", "function": {"name": "f"}},
    "openai_common.StreamOptions": {},
    "openai_chat.ChatCompletionRequest": {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
    },
    "databricks_chat.ResponseFormat": {"type": "text"},
    "databricks_chat.ChatMessage": {"role": "user"},
    "openai_chat.ChatMessage": {"role": "user", "content": "hi"},
    "databricks_chat.ToolCall": {"id": "call_1", "function": {"name": "f", "arguments": "{}"}},
    "tokenize.TokenizeCompletion": {"prompt": "hi"},
    "tokenize.TokenizeChat": {"messages": [{"role": "user", "content": "hi"}]},
    "tokenize.Detokenize": {"tokens": [1, 2]},
}


def _models() -> list[type[RequestModel]]:
    found, todo = [], list(RequestModel.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda c: (c.__module__, c.__name__))


MODELS = _models()


def _key(cls) -> str:
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def test_every_request_model_has_a_minimal_body():
    assert {_key(c) for c in MODELS} == set(MINIMAL), "add the new model to MINIMAL"


OPTIONAL = [
    pytest.param(cls, name, id=f"{_key(cls)}.{name}")
    for cls in MODELS
    for name, field in cls.model_fields.items()
    if not field.is_required() and name not in MINIMAL[_key(cls)]
]


@pytest.mark.parametrize(("cls", "name"), OPTIONAL)
def test_null_is_the_same_as_not_given(cls, name):
    minimal = MINIMAL[_key(cls)]
    assert cls.model_validate({**minimal, name: None}) == cls.model_validate(minimal)


REQUIRED = [
    pytest.param(cls, name, id=f"{_key(cls)}.{name}")
    for cls in MODELS
    for name, field in cls.model_fields.items()
    if field.is_required() and field.alias is None
]


@pytest.mark.parametrize(("cls", "name"), REQUIRED)
def test_null_for_a_required_field_is_refused(cls, name):
    with pytest.raises(ValidationError) as caught:
        cls.model_validate({**MINIMAL[_key(cls)], name: None})
    assert caught.value.errors()[0]["loc"][0] == name
