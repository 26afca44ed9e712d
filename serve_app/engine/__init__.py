"""The inference engine: continuous batching over a paged KV cache.

Sits at the end of the request path (ingress -> tokenizer pool -> model replica -> engine).
Imports no fastapi, pydantic or ray: it runs the same in a replica, a script or a test.
docs/engine.md says where each part lives.

The names below are the engine's public ones. None of their modules imports the model code or
torch when imported (`LLM` loads the model runner when one is made, `AsyncEngine` when it runs
the step loop in this process), so a process that only needs the engine's config or its request
and output types (the ingress, the tokenizer pool) imports them as it likes. The engine itself
(`llm_engine.LLMEngine`) is imported from its module.
"""

from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import EngineError, RequestRejected
from serve_app.engine.host.async_engine import AsyncEngine
from serve_app.engine.inputs import EngineRequest
from serve_app.engine.llm import LLM
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
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "StepMetrics",
    "TokenLogprob",
]
