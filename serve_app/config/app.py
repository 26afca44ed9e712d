"""`AppConfig`: the whole application config (Ray Serve application `args`), and what the
deployments derive from it: each model's `EngineConfig`, the token-count rules, the mode, the
embedding endpoints."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from serve_app.config.backend import BackendConfig, cross_check, mindie_values
from serve_app.config.deployments import Deployments
from serve_app.config.effects import Section, acts
from serve_app.config.embedding import EmbeddingConfig, name_problems
from serve_app.config.server import ServerConfig
from serve_app.engine.config import MINDIE_ALIASES, EngineConfig
from serve_app.placement import resolve_cpus, serving_cores

_ServerConfig, _BackendConfig, _Deployments = ServerConfig, BackendConfig, Deployments
_EmbeddingConfig = EmbeddingConfig


class AppConfig(Section):
    """The whole application config: Ray Serve application `args`, MindIE config.json names."""

    ServerConfig: _ServerConfig = Field(
        default_factory=_ServerConfig,
        description="HTTP front end: address, limits, timeouts.",
        json_schema_extra=acts(),
    )
    BackendConfig: _BackendConfig = Field(
        default_factory=_BackendConfig,
        description="Devices, models and scheduling.",
        json_schema_extra=acts(),
    )
    EmbeddingConfig: tuple[_EmbeddingConfig, ...] = Field(
        (),
        description=(
            "(extension) Embedding endpoints, one deployment each; empty (default) = none."
        ),
        json_schema_extra=acts(),
    )
    Deployments: _Deployments = Field(
        default_factory=_Deployments,
        description="(extension) Ray Serve options per deployment: replicas, resources.",
        json_schema_extra=acts(),
    )

    @model_validator(mode="after")
    def _unique_names(self) -> AppConfig:
        cross_check(name_problems(self.EmbeddingConfig, self.model_names))
        return self

    @property
    def model_names(self) -> list[str]:
        return [m.modelName for m in self.BackendConfig.ModelDeployConfig.ModelConfig]

    @property
    def embedding_names(self) -> list[str]:
        """The embedding endpoints served, in EmbeddingConfig order."""
        return [e.endpointName for e in self.EmbeddingConfig]

    @property
    def pd_mode(self) -> bool:
        """inferMode dmi: prefill and decode on separate replicas."""
        return self.ServerConfig.inferMode == "dmi"

    def engine_config(self, model_index: int = 0, role: str = "colocated") -> EngineConfig:
        """The frozen engine settings for ModelConfig[model_index]'s replicas of `role`
        (already checked: the engine's rules ran when this config loaded)."""
        deploy, sched = self.BackendConfig.ModelDeployConfig, self.BackendConfig.ScheduleConfig
        if not 0 <= model_index < len(deploy.ModelConfig):
            raise IndexError(f"ModelDeployConfig.ModelConfig has no item {model_index}")
        model = deploy.ModelConfig[model_index]
        values = mindie_values(deploy, sched, model)
        server = self.ServerConfig
        values.update(tokenTimeout=server.tokenTimeout, e2eTimeout=server.e2eTimeout)
        fields = {MINDIE_ALIASES[key]: v for key, v in values.items() if key in MINDIE_ALIASES}
        for name in ("kv_cache_mem_gb", "token_timeout_s", "e2e_timeout_s"):
            fields[name] = float(fields[name])
        return EngineConfig(
            **fields,
            dtype=model.dtype,
            device=model.device,
            engine_process=model.engineProcess,
            engine_cpus=resolve_cpus(model.engineCpus),
            engine_spare_cpus=resolve_cpus(model.engineSpareCpus, spare=True),
            enforce_eager=model.enforceEager,
        ).replace(world_size=model.world_size(role))

    def serving_cores(self) -> set[int] | None:
        """The cores the ingress and the tokenizer pool keep to on this node: those no
        model's engine process is bound to (None: no binding, or nothing left)."""
        bound = {c for m in self.BackendConfig.ModelDeployConfig.ModelConfig
                 for c in resolve_cpus(m.engineCpus)}  # fmt: skip
        return serving_cores(bound)


def accelerator_env() -> dict[str, str | None]:
    """The device visibility Ray set for this worker (it pins NPUs/GPUs through these); the
    only environment the app reads."""
    return {
        name: os.environ.get(name) for name in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    }
