"""The inference engine: continuous batching over a paged KV cache.

Sits at the end of the request path (ingress -> tokenizer pool -> model replica -> engine).
Imports no fastapi, pydantic or ray: it runs the same in a replica, a script or a test.

The names below are imported on first use (PEP 562), so that a process that only needs the
engine's config or its request and output types (the ingress, the tokenizer pool) does not
import the model runner and transformers with it (~5 s of CPU per process on a 2-core machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "LLM": "llm",
    "AsyncEngine": "host.async_engine",
    "CompletionOutput": "outputs",
    "EngineConfig": "config",
    "EngineError": "errors",
    "EngineRequest": "inputs",
    "FinishReason": "params",
    "LLMEngine": "llm_engine",
    "RequestOutput": "outputs",
    "RequestRejected": "errors",
    "SamplingParams": "params",
    "StepMetrics": "outputs",
    "TokenLogprob": "outputs",
}
__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "EngineRequest",
    "FinishReason",
    "LLMEngine",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "StepMetrics",
    "TokenLogprob",
]

if TYPE_CHECKING:
    from serve_app.engine.config import EngineConfig
    from serve_app.engine.errors import EngineError, RequestRejected
    from serve_app.engine.host.async_engine import AsyncEngine
    from serve_app.engine.inputs import EngineRequest
    from serve_app.engine.llm import LLM
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.outputs import CompletionOutput, RequestOutput, StepMetrics, TokenLogprob
    from serve_app.engine.params import FinishReason, SamplingParams


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
