"""The inference engine: continuous batching over a paged KV cache.

Sits at the end of the request path (ingress -> tokenizer pool -> model replica -> engine).
Imports no fastapi, pydantic or ray: it runs the same in a replica, a script or a test.
"""

from serve_app.engine.async_engine import AsyncEngine
from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.llm import LLM
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.outputs import CompletionOutput, RequestOutput, StepMetrics, TokenLogprob
from serve_app.engine.params import FinishReason, SamplingParams

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
