"""(extension) Ray Serve options per deployment: the `Deployments` section of the config.

Part of the config tree (serve_app/config/) (same rules: unknown keys refused with their
dotted path, frozen); kept apart because it is Ray Serve's vocabulary, not MindIE's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.config.effects import Section, acts

_ACTOR_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "runtime_env")
# Ray Serve's LoggingConfig fields
_LOGGING_KEYS = (
    "encoding", "log_level", "logs_dir", "enable_access_log", "additional_log_standard_attrs",
)  # fmt: skip
_KNOWN_KEYS = {"ray_actor_options": _ACTOR_KEYS, "logging_config": _LOGGING_KEYS}


def _cpu_count(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() == "auto"
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


class DeploymentOptions(Section):
    """(extension) Ray Serve options of one deployment; unset keys keep our defaults."""

    num_replicas: int | Literal["auto"] | None = Field(
        None,
        description=(
            "Replica count, or 'auto' for Ray Serve autoscaling (a model replica deployment's "
            "target_ongoing_requests defaults to ScheduleConfig.maxBatchSize)."
        ),
        json_schema_extra=acts(),
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description=(
            "Ray Serve autoscaling_config (min_replicas, max_replicas, ...); on a model replica "
            "deployment target_ongoing_requests defaults to ScheduleConfig.maxBatchSize, the "
            "requests one engine runs at once, and metrics_interval_s (how often the load is "
            "reported) to 2 s, below look_back_period_s."
        ),
        json_schema_extra=acts(),
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one replica works on at once.",
        json_schema_extra=acts(),
    )
    max_queued_requests: int | None = Field(
        None,
        ge=-1,
        description="Requests queued at the handle before 503s; -1 = no limit.",
        json_schema_extra=acts(),
    )
    health_check_period_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Seconds between Ray Serve's health checks of a replica (a model replica whose "
            "engine died fails its next one and is replaced); model replicas default to 10."
        ),
        json_schema_extra=acts(),
    )
    health_check_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Seconds a health check may take before the replica counts as unhealthy; model "
            "replicas default to 60."
        ),
        json_schema_extra=acts(),
    )
    graceful_shutdown_wait_loop_s: float | None = Field(
        None,
        ge=0,
        description=(
            "Seconds between a stopping replica's checks for requests still running (Ray Serve "
            "drains a replica before stopping it: scale-down, redeploy, shutdown)."
        ),
        json_schema_extra=acts(),
    )
    graceful_shutdown_timeout_s: float | None = Field(
        None,
        ge=0,
        description=(
            "Seconds a stopping replica's running requests get to finish before it is killed "
            "(Ray Serve's default: 20); give model replicas the longest stream you serve."
        ),
        json_schema_extra=acts(),
    )
    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        description="At most this many replicas of the deployment on one node.",
        json_schema_extra=acts(),
    )
    placement_group_bundles: tuple[dict[str, float], ...] | None = Field(
        None,
        min_length=1,
        description=(
            "Resources of a placement group per replica, a bundle per entry (e.g. "
            "[{NPU: 1, CPU: 1}, {NPU: 1}]): the replica runs in the first bundle, which must "
            "hold its ray_actor_options' resources; what it starts may use the others."
        ),
        json_schema_extra=acts(),
    )
    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = (
        Field(
            None,
            description=(
                "How placement_group_bundles are placed (STRICT_PACK: all on one node); needs "
                "placement_group_bundles."
            ),
            json_schema_extra=acts(),
        )
    )
    request_router_config: dict[str, Any] | None = Field(
        None,
        description=(
            "Ray Serve's request router of the deployment's handles: request_router_class (an "
            "import path), request_router_kwargs, request_routing_stats_period_s, "
            "request_routing_stats_timeout_s. Model and prefill replicas default to the "
            "prefix-aware router (serve_app.routing.prefix_router:PrefixAwareRouter) while "
            "enablePrefixCaching is on."
        ),
        json_schema_extra=acts(),
    )
    ray_actor_options: dict[str, Any] | None = Field(
        None,
        description=(
            "Ray actor options: num_cpus, num_gpus, memory, resources (e.g. {NPU: 1}), "
            "accelerator_type, runtime_env. Merged over the options derived from the device. "
            "Model replica deployments (ModelReplica, Prefill, Decode) default to num_cpus "
            "'auto': sized to the node when the app is built (of n CPUs the serving path keeps "
            "max(1, n // 8), the model ranks sharing the node split the rest: 1 on 2 cores, 14 "
            "on 16); the other deployments take numbers only."
        ),
        json_schema_extra=acts(),
    )

    logging_config: dict[str, Any] | None = Field(
        None,
        description=(
            "Ray Serve logging_config of the deployment: encoding, log_level, logs_dir, "
            "enable_access_log, additional_log_standard_attrs. The tokenizer pool, model and "
            "embedding replicas default to enable_access_log false (the ingress logs each HTTP "
            "request); keys set here are merged over that."
        ),
        json_schema_extra=acts(),
    )

    @field_validator("num_replicas")
    @classmethod
    def _replicas(cls, value):
        if isinstance(value, int) and value < 0:
            raise ValueError(f"must be >= 0 or 'auto', got {value}")
        return value

    @field_validator("ray_actor_options", "logging_config")
    @classmethod
    def _known_keys(cls, value, info):
        known = _KNOWN_KEYS[info.field_name]
        unknown = sorted(set(value or {}) - set(known))
        if unknown:
            raise ValueError(
                f"unknown {info.field_name} key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        cpus = (value or {}).get("num_cpus") if info.field_name == "ray_actor_options" else None
        if cpus is not None and not _cpu_count(cpus):
            raise ValueError(f"num_cpus must be a number >= 0 or 'auto', got {cpus!r}")
        return value

    @model_validator(mode="after")
    def _placement_rules(self) -> DeploymentOptions:
        if self.placement_group_strategy is not None and self.placement_group_bundles is None:
            raise ValueError("placement_group_strategy needs placement_group_bundles")
        if self.max_replicas_per_node is not None and self.placement_group_bundles is not None:
            raise ValueError(
                "max_replicas_per_node and placement_group_bundles cannot both be set (Ray "
                "Serve refuses it): spread the bundles with placement_group_strategy instead"
            )
        return self

    def serve_options(self) -> dict[str, Any]:
        """The keys that are set, as `serve.deployment(...)` keyword arguments."""
        # (the config's lists are tuples, to stay frozen; Ray Serve takes lists)
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in self.model_dump().items()
            if v is not None
        }


class Deployments(Section):
    """(extension) Per-deployment Ray Serve options, by deployment name."""

    @model_validator(mode="after")
    def _auto_cpus_on_model_replicas(self) -> Deployments:
        for name in ("Ingress", "TokenizerPool", "EmbeddingReplica"):
            actor = getattr(self, name).ray_actor_options or {}
            if isinstance(actor.get("num_cpus"), str):
                raise ValueError(
                    f"Deployments.{name}.ray_actor_options.num_cpus: 'auto' sizes model replicas "
                    "(ModelReplica, Prefill, Decode) only; give a number of CPUs"
                )
        return self

    Ingress: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "The FastAPI ingress. Defaults: 1 replica, num_cpus 0; each replica runs "
            "ServerConfig.maxLinkNum / num_replicas requests at once, queues twice as many and "
            "refuses the rest (503, 429 on Databricks paths); Ray Serve's max_ongoing_requests "
            "and max_queued_requests sit above that."
        ),
        json_schema_extra=acts(),
    )
    TokenizerPool: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "The tokenizer pool. Defaults: BackendConfig.tokenizerProcessNumber replicas, "
            "num_cpus 0."
        ),
        json_schema_extra=acts(),
    )
    ModelReplica: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "Model replicas (one deployment per served model). Defaults: 1 replica, num_cpus "
            "'auto' (sized to the node); the accelerator from ModelConfig.device and worldSize "
            "(NPU resource, num_gpus or CPU)."
        ),
        json_schema_extra=acts(),
    )
    Prefill: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "inferMode dmi: the prefill replicas (one deployment per served model); defaults as "
            "for ModelReplica."
        ),
        json_schema_extra=acts(),
    )
    Decode: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "inferMode dmi: the decode replicas (one deployment per served model); defaults as "
            "for ModelReplica."
        ),
        json_schema_extra=acts(),
    )
    EmbeddingReplica: DeploymentOptions = Field(
        default_factory=DeploymentOptions,
        description=(
            "Embedding replicas (one deployment per EmbeddingConfig[] endpoint). Defaults: 1 "
            "replica, num_cpus 1 (its torch threads: Ray sets them from num_cpus)."
        ),
        json_schema_extra=acts(),
    )
