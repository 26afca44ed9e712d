"""What a caller hands the engine: one request, whatever its role.

A plain request is generated here from its prompt. For prefill/decode disaggregation the same
object says which half this engine runs: `export_kv` (a prefill: one token, then the prompt's KV
on the final output) or `imported` (a decode: continue another engine's prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.engine.kv_transfer import ImportedPrefill
from serve_app.engine.params import DEFAULT_PRIORITY, SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = DEFAULT_PRIORITY  # 1 highest .. 5 lowest
    deadline: float | None = None  # time.monotonic() deadline of this request
    export_kv: bool = False  # PD prefill: one token, then the prompt's KV on the final output
    imported: ImportedPrefill | None = None  # PD decode: continue another engine's prefill
    # When the request reached the engine's owner (None: when the engine takes it). AsyncEngine
    # stamps it on hand-over, so that time spent in its inbox behind a long running step counts
    # as queueing, not as prefill.
    arrival_time: float | None = None
    e2e_start: float | None = None  # PD decode: when the e2eTimeout window began (prefill)
