"""`ModelConfig`: one entry of `ModelDeployConfig.ModelConfig[]`, a model served (MindIE names,
with our extensions: dtype, device, the engine process and its cores, eager decode steps), and
the rule for names clients send."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.effects import Section, acts, no_effect
from serve_app.engine import config as engine_config
from serve_app.engine.config import DEVICES, DTYPES, EngineConfig
from serve_app.placement import AUTO, format_cpus, parse_cpus, resolve_cpus

_ENGINE = EngineConfig()  # the engine's defaults are the config's defaults


def served_name(value: str) -> str:
    """A name clients send (a model, an embedding endpoint): URL-safe, as in the routes."""
    allowed = all(c.isascii() and (c.isalnum() or c in "-._") for c in value)
    if not allowed or value[0] in "-._" or value[-1] in "-._":
        raise ValueError(
            f"{value!r} must be letters, digits, '-', '.', '_' and must not "
            "start or end with '-', '.', '_'"
        )
    return value


class ModelConfig(Section):
    modelName: str = Field(
        _ENGINE.model_name,
        min_length=1,
        max_length=256,
        description=(
            "Name clients send as `model`: letters, digits, '-', '.', '_', not starting or ending "
            "with '-', '.', '_'; at most 256 characters."
        ),
        json_schema_extra=acts(),
    )
    modelWeightPath: str = Field(
        _ENGINE.model,
        min_length=1,
        description=(
            "Folder of Hugging Face safetensors weights; a Hugging Face hub id "
            "('owner/name', optionally '@revision') that is no local path, fetched into the "
            "Hugging Face cache (HF_HUB_CACHE or HF_HOME; HF_HUB_OFFLINE=1: the cache only; "
            "HF_TOKEN for gated repos) by each process that loads it; or a built-in model: "
            "'smollm2-135m-instruct' (SmolLM2-135M-Instruct, converted on first use), 'demo' / "
            "'demo-tiny' / 'demo-1b' (random weights for tests and benchmarks; 'demo-1b' is "
            "1B-class, for accelerators)."
        ),
        json_schema_extra=acts(),
    )
    worldSize: int = Field(
        1,
        ge=1,
        description=(
            "Devices one instance of the model spans (tensor parallelism): the model is split "
            "over worldSize ranks by heads and MLP features, one device each, and each rank "
            "holds its part of the weights and of the KV cache. The replica is rank 0; the "
            "other ranks are Ray actors in its placement group (worldSize bundles on one node). "
            "Must divide the model's attention heads and MLP size (and divide or be a multiple "
            "of its KV heads), and the model's tensor-parallel plan must split only by columns "
            "and rows (Llama, Qwen2 and the like); checked when the config loads where the "
            "model's config.json is on disk, else when it loads. Above the most NPUs (or GPUs) "
            "one running node has, refused when the app is built (not where none has any yet)."
        ),
        json_schema_extra=acts(),
    )
    prefillWorldSize: int | None = Field(
        None,
        ge=1,
        description=(
            "(extension) worldSize of this model's prefill replicas in PD mode (inferMode dmi); "
            "unset: worldSize. The KV hand-off moves every KV head, so the prefill and decode "
            "sides may be split differently."
        ),
        json_schema_extra=acts(),
    )
    decodeWorldSize: int | None = Field(
        None,
        ge=1,
        description="(extension) worldSize of this model's decode replicas in PD mode; unset: "
        "worldSize.",
        json_schema_extra=acts(),
    )
    cpuMemSize: int = Field(
        5,
        ge=0,
        description="Host memory for swapped-out KV cache, in GB.",
        json_schema_extra=no_effect(
            "nothing is swapped to host memory: a preempted request's blocks are freed and it is "
            "recomputed later; size the KV pool with npuMemSize or kvCacheBlocks"
        ),
    )
    npuMemSize: float = Field(
        _ENGINE.kv_cache_mem_gb,
        description=(
            "KV cache per device, in GB: a replica over worldSize N devices holds N times it; "
            "-1 = auto (80% of the device's free memory, the least over a replica's ranks; "
            "2 GB on CPU)."
        ),
        json_schema_extra=acts(),
    )
    dtype: Literal[DTYPES] = Field(  # type: ignore[valid-type]
        _ENGINE.dtype,
        description=(
            "(extension) Weight and activation dtype; auto = bfloat16 on accelerators and on "
            "CPUs with bfloat16 arithmetic (AVX512-BF16, AMX), else float32."
        ),
        json_schema_extra=acts(),
    )
    device: Literal[DEVICES] = Field(  # type: ignore[valid-type]
        _ENGINE.device,
        description="(extension) Device to run on; auto = npu if present, else cuda, else cpu.",
        json_schema_extra=acts(),
    )
    trustRemoteCode: bool = Field(
        False,
        description=(
            "(extension) Allow model code shipped with the weights "
            "(transformers trust_remote_code)."
        ),
        json_schema_extra=no_effect(
            "model code shipped with the weights is never run: the model loads only if "
            "transformers itself has its architecture",
            when=("==", True),
        ),
    )

    engineProcess: bool = Field(
        _ENGINE.engine_process,
        description=(
            "(extension) Run the engine's step loop in a process of its own, so that it never "
            "waits on the replica's per-token work (detokenizing, streaming) for Python's "
            "interpreter lock."
        ),
        json_schema_extra=acts(),
    )
    engineCpus: str = Field(
        "",
        description=(
            "(extension) Cores the engine process is bound to, e.g. '1', '0-3' or '0,2,4-5' "
            "(needs engineProcess: true); its torch threads are these cores, and the ingress "
            "and tokenizer pool keep to the other cores of the node. 'auto': sized to the node "
            "the replica runs on (of n cores the serving path keeps the lowest max(1, n // 8), "
            "the engine the rest; nothing bound on one core). Empty = no binding."
        ),
        json_schema_extra=acts(),
    )
    engineSpareCpus: str = Field(
        "",
        description=(
            "(extension) Cores whose idle time the engine process borrows for its CPU GEMMs, "
            "decode attention and greedy argmax, e.g. "
            "'0' (needs engineProcess: true; not engineCpus): a helper thread per core at the "
            "lowest priority (Linux SCHED_IDLE), which the step never waits for. 'auto': the "
            "cores engineCpus 'auto' leaves to the serving path. Empty = none."
        ),
        json_schema_extra=acts(),
    )

    enforceEager: bool = Field(
        _ENGINE.enforce_eager,
        description=(
            "(extension) On CUDA, run every decode step eagerly instead of replaying the decode "
            "steps captured as CUDA graphs at start (one graph per padded batch size)."
        ),
        json_schema_extra=acts(),
    )

    @field_validator("engineCpus", "engineSpareCpus")
    @classmethod
    def _cpus(cls, value: str) -> str:
        if value.strip().lower() == AUTO:
            return AUTO
        return format_cpus(parse_cpus(value))  # ValueError names the bad part

    @model_validator(mode="after")
    def _cpus_need_process(self) -> ModelConfig:
        # `auto` is checked as it comes out on this machine (a replica sizes it to its node)
        cpus = resolve_cpus(self.engineCpus), resolve_cpus(self.engineSpareCpus, spare=True)
        found = engine_config.cpus_problems(self.engineProcess, *cpus)
        if not self.engineProcess and AUTO in (self.engineCpus, self.engineSpareCpus):
            found.append("engineCpus auto needs engineProcess: true (it binds the engine process)")
        if found:
            raise ValueError(found[0])
        return self

    def world_size(self, role: str = "colocated") -> int:
        """The worldSize of this model's replicas of `role` (colocated, prefill, decode)."""
        own = {"prefill": self.prefillWorldSize, "decode": self.decodeWorldSize}.get(role)
        return own or self.worldSize

    @model_validator(mode="after")
    def _splits(self) -> ModelConfig:
        sizes = {self.world_size(role) for role in ("colocated", "prefill", "decode")} - {1}
        if sizes:
            from serve_app.engine.backends.parallel.plan import problems
            from serve_app.models.loader import config_on_disk

            hf_config = config_on_disk(self.modelWeightPath)
            for size in sorted(sizes) if hf_config is not None else ():
                found = problems(hf_config, size)
                if found:
                    raise ValueError(found[0])
        return self

    @field_validator("modelName")
    @classmethod
    def _name(cls, value: str) -> str:
        return served_name(value)

    @field_validator("npuMemSize")
    @classmethod
    def _mem(cls, value: float) -> float:
        if value != -1 and value <= 0:
            raise ValueError(f"must be -1 (auto) or > 0 GB, got {value:g}")
        return value
