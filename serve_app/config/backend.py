"""`BackendConfig`: devices, the models served, sequence limits and scheduling (MindIE names).

Defaults, dtype/device choices and the rules between engine settings come from the engine's own
config (`serve_app.engine.config`), so they are written once; the rules that involve keys the
engine never sees (maxPreemptCount, cpuMemSize, unique model names) live here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from serve_app.config.effects import Section, acts, no_effect, refused
from serve_app.config.model import ModelConfig
from serve_app.engine import config as engine_config
from serve_app.engine.config import EngineConfig

_ENGINE = EngineConfig()  # the engine's defaults are the config's defaults
_SCHED = "BackendConfig.ScheduleConfig"
_DEPLOY = "BackendConfig.ModelDeployConfig"


def cross_check(problems: list[str]) -> None:
    """Rules across keys fail as one error whose lines name both keys by their paths."""
    if problems:
        raise PydanticCustomError("cross_check", "{detail}", {"detail": "\n".join(problems)})


_ModelConfig = ModelConfig  # the field below is named like the class; pydantic needs an alias
_ORDER = (
    "the engine admits waiting requests by their priority, then by arrival (first come, first "
    "served among equals); a request sets its own priority"
)
_PREEMPT = (
    "when the KV pool runs out the engine preempts the newest, lowest-priority running requests "
    "by freeing their blocks and recomputing them later, with no cap; nothing is swapped to "
    "host memory"
)


class ModelDeployConfig(Section):
    maxSeqLen: int = Field(
        _ENGINE.max_seq_len,
        ge=1,
        description="Longest sequence, prompt plus output, tokens.",
        json_schema_extra=acts(),
    )
    maxInputTokenLen: int = Field(
        _ENGINE.max_input_token_len,
        ge=1,
        le=4194304,
        description=(
            "Longest prompt in tokens; the effective limit is min(maxInputTokenLen, maxSeqLen - 1)."
        ),
        json_schema_extra=acts(),
    )
    truncation: bool = Field(
        _ENGINE.truncation,
        description="Too-long prompts: true = cut, false = reject.",
        json_schema_extra=acts(),
    )
    ModelConfig: tuple[_ModelConfig, ...] = Field(
        (_ModelConfig(),),
        min_length=1,
        description="Models served (at least one); the default is the built-in demo model.",
        json_schema_extra=acts(),
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ModelDeployConfig:
        seen: dict[str, int] = {}
        problems = []
        for i, model in enumerate(self.ModelConfig):
            if model.modelName in seen:
                problems.append(
                    f"{_DEPLOY}.ModelConfig[{i}].modelName ({model.modelName!r}) repeats "
                    f"{_DEPLOY}.ModelConfig[{seen[model.modelName]}].modelName; names must be "
                    "unique"
                )
            seen.setdefault(model.modelName, i)
        cross_check(problems)
        return self


# The engine's scheduler (serve_app/engine/scheduler.py) builds every step from the running
# requests' next tokens plus waiting prompts, chunking a prompt past maxPrefillTokens: MindIE's
# knobs for choosing between prefill and decode steps have nothing to choose here.
_MIXED_STEPS = (
    "every engine step runs the running requests' next tokens and admits waiting prompts beside "
    "them (chunked by maxPrefillTokens), so there is no prefill-or-decode step to choose; "
    "tune maxPrefillTokens and maxPrefillBatchSize instead"
)


class ScheduleConfig(Section):
    templateType: Literal["Standard", "Mix"] = Field(
        "Standard",
        description="Standard: prefill and decode in separate steps; Mix: SplitFuse.",
        json_schema_extra=no_effect(_MIXED_STEPS),
    )
    cacheBlockSize: int = Field(
        _ENGINE.block_size,
        ge=1,
        le=128,
        description="Tokens per KV cache block.",
        json_schema_extra=acts(),
    )
    maxPrefillBatchSize: int = Field(
        _ENGINE.max_prefill_batch_size,
        ge=1,
        description="Most prompts (new or continued) computed in one engine step.",
        json_schema_extra=acts(),
    )
    maxPrefillTokens: int = Field(
        _ENGINE.max_prefill_tokens,
        ge=1,
        description="Most prompt tokens in one engine step; a longer prompt goes over several.",
        json_schema_extra=acts(),
    )
    prefillTimeMsPerReq: int = Field(
        150,
        ge=0,
        description="Expected prefill time per request, ms (used by supportSelectBatch).",
        json_schema_extra=no_effect(_MIXED_STEPS),
    )
    decodeTimeMsPerReq: int = Field(
        50,
        ge=0,
        description="Expected decode time per request, ms (used by supportSelectBatch).",
        json_schema_extra=no_effect(_MIXED_STEPS),
    )
    prefillPolicyType: int = Field(
        0,
        ge=0,
        le=3,
        description="Prefill queue policy: 0 FCFS, 1 STATE, 2 PRIORITY, 3 MLFQ.",
        json_schema_extra=no_effect(_ORDER),
    )
    decodePolicyType: int = Field(
        0,
        ge=0,
        le=3,
        description="Decode queue policy: 0 FCFS, 1 STATE, 2 PRIORITY, 3 MLFQ.",
        json_schema_extra=no_effect(_ORDER),
    )
    maxBatchSize: int = Field(
        _ENGINE.max_batch_size,
        ge=1,
        le=5000,
        description="Most sequences in one engine step (the running batch).",
        json_schema_extra=acts(),
    )
    maxIterTimes: int = Field(
        _ENGINE.max_iter_times,
        ge=1,
        description="Most tokens generated for one request.",
        json_schema_extra=acts(),
    )
    maxPreemptCount: int = Field(
        0,
        ge=0,
        description=(
            "Most requests preempted (swapped to host memory) at once; > 0 needs cpuMemSize > 0."
        ),
        json_schema_extra=no_effect(_PREEMPT),
    )
    supportSelectBatch: bool = Field(
        False,
        description="Choose prefill or decode steps by the per-request time estimates.",
        json_schema_extra=no_effect(_MIXED_STEPS),
    )
    maxQueueDelayMicroseconds: int = Field(
        5000,
        ge=0,
        description="Longest wait to fill a batch, in microseconds.",
        json_schema_extra=no_effect(
            "the engine steps as soon as a request waits and never holds one back to fill a "
            "batch; requests arriving during a step join the next one"
        ),
    )
    maxFirstTokenWaitTime: int = Field(
        2500,
        ge=0,
        description="Longest wait for a first token before prefill is favoured, in ms.",
        json_schema_extra=no_effect(_MIXED_STEPS),
    )
    kvCacheBlocks: int = Field(
        _ENGINE.num_kv_blocks,
        ge=0,
        description="(extension) KV pool size in blocks, on any device; 0 = size it by npuMemSize.",
        json_schema_extra=acts(),
    )
    enablePrefixCaching: bool = Field(
        _ENGINE.enable_prefix_caching,
        description="(extension) Reuse KV cache blocks of identical prompt prefixes.",
        json_schema_extra=acts(),
    )


_ModelDeployConfig, _ScheduleConfig = ModelDeployConfig, ScheduleConfig


class BackendConfig(Section):
    npuDeviceIds: tuple[tuple[Annotated[int, Field(ge=0)], ...], ...] = Field(
        ((0,),),
        min_length=1,
        description="Logical device ids, one list per model instance.",
        json_schema_extra=no_effect(
            "Ray gives each replica its devices (worldSize of them); set the replica count with "
            "Deployments.ModelReplica.num_replicas and the visible devices with "
            "ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES where Ray starts"
        ),
    )
    tokenizerProcessNumber: int = Field(
        8,
        ge=1,
        le=32,
        description=(
            "Tokenizer processes: the tokenizer pool's replica count, unless "
            "Deployments.TokenizerPool.num_replicas sets it."
        ),
        json_schema_extra=acts(),
    )
    multiNodesInferEnabled: bool = Field(
        False,
        description="One model instance spans nodes.",
        json_schema_extra=refused(
            "one model instance across nodes is not supported: a replica's worldSize ranks run "
            "on devices of one node; split a model over one node's devices with worldSize, "
            "serve on more nodes with more replicas (Deployments.ModelReplica.num_replicas) and "
            "set multiNodesInferEnabled: false",
            when=("==", True),
        ),
    )
    ModelDeployConfig: _ModelDeployConfig = Field(
        default_factory=_ModelDeployConfig,
        description="Sequence limits and the models served.",
        json_schema_extra=acts(),
    )
    ScheduleConfig: _ScheduleConfig = Field(
        default_factory=_ScheduleConfig,
        description="Batching and KV cache scheduling.",
        json_schema_extra=acts(),
    )

    @model_validator(mode="after")
    def _cross(self) -> BackendConfig:
        deploy, sched = self.ModelDeployConfig, self.ScheduleConfig
        where = {**dict.fromkeys(_DEPLOY_KEYS, _DEPLOY), **dict.fromkeys(_SCHED_KEYS, _SCHED)}
        problems = engine_config.problems(
            mindie_values(deploy, sched),
            path=lambda key: f"{where[key]}.{key}",
            rules=engine_config.CROSS_RULES + (("maxPreemptCount", "<=", "maxBatchSize"),),
        )
        if sched.maxPreemptCount > 0:
            problems += [
                f"{_SCHED}.maxPreemptCount ({sched.maxPreemptCount}) > 0 requires "
                f"{_DEPLOY}.ModelConfig[{i}].cpuMemSize > 0 (got {model.cpuMemSize})"
                for i, model in enumerate(deploy.ModelConfig)
                if model.cpuMemSize <= 0
            ]
        cross_check(problems)
        return self


_DEPLOY_KEYS = ("maxSeqLen", "maxInputTokenLen", "truncation")
_SCHED_KEYS = (
    "maxIterTimes", "maxBatchSize", "maxPrefillBatchSize", "maxPrefillTokens", "cacheBlockSize",
    "kvCacheBlocks", "enablePrefixCaching", "maxPreemptCount",
)  # fmt: skip


def mindie_values(
    deploy: ModelDeployConfig, sched: ScheduleConfig, model: ModelConfig | None = None
) -> dict:
    """The engine's settings by MindIE name, read from the sections that hold them."""
    values = {key: getattr(deploy, key) for key in _DEPLOY_KEYS}
    values.update({key: getattr(sched, key) for key in _SCHED_KEYS})
    if model is not None:
        values.update(
            {
                key: getattr(model, key)
                for key in ("modelName", "modelWeightPath", "npuMemSize", "worldSize")
            }  # fmt: skip
        )
    return values
