"""Ray Serve options of each deployment, derived from the config in one place.

Accelerator pinning: a model replica asks Ray for its devices as resources, and Ray tells the
worker which ones it got through an environment variable the device runtime honours:
`resources: {NPU: 1}` on Ascend (Ray sets ASCEND_RT_VISIBLE_DEVICES), `num_gpus: 1` on CUDA
(CUDA_VISIBLE_DEVICES), nothing on CPU. With worldSize N above 1 the replica asks for a
placement group of N such bundles on one node (STRICT_PACK): it is rank 0, and the model's
other ranks are actors it starts in the other bundles (replica/ranks.py). `device: auto` picks
from what the cluster advertises when Ray is up, else from what this machine has. The user's
`Deployments.<name>` options are merged over these defaults (resources dict merged key by key).

Every deployment also runs with Ray Serve's streaming fast path (`SERVE_FAST_PATH_ENV`, in the
replica's runtime_env; a user's own env_vars win key by key): user code on the replica's own
event loop instead of a second thread, gRPC as the default of handles made in the replicas (the
ingress's bound handles are made by the app's builder: it asks for gRPC itself,
`ingress/deployment.over_grpc`), and the handle's router on the caller's loop. Each streamed
chunk then costs fewer thread hops and no Ray task submission, CPU that on 2 cores comes out
of the engine's share (docs/performance.md, "Over HTTP").
Ray Serve's own request metrics are exported once a second instead of ten times (each replica,
and each handle's router, wakes up for it).
"""

from __future__ import annotations

import glob
from typing import Any

from serve_app.config import AppConfig
from serve_app.config.deployments import DeploymentOptions
from serve_app.placement import AUTO
from serve_app.replica_cpus import (
    DEVICE_RESOURCE,
    NPU_DEVICE_FILES,
    auto_num_cpus,
    is_auto,
    live_nodes,
    replicas_of,
)


def detect_accelerator(cluster_resources: dict | None = None) -> str:
    """'npu', 'cuda' or 'cpu' for device auto: the cluster's resources, else this machine."""
    if cluster_resources is None:
        try:
            import ray

            if ray.is_initialized():
                cluster_resources = ray.cluster_resources()
        except Exception:  # no Ray here: look at the local machine
            cluster_resources = None
    if cluster_resources is not None:
        if cluster_resources.get("NPU", 0) > 0:
            return "npu"
        return "cuda" if cluster_resources.get("GPU", 0) > 0 else "cpu"
    if glob.glob(NPU_DEVICE_FILES):
        return "npu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


METRICS_INTERVAL = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
SERVE_FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    METRICS_INTERVAL: "1000",
}


# How often the handles report a model deployment's load to Ray Serve's autoscaler (one small call
# per ingress replica).
AUTOSCALING_REPORT_S = 2.0

# Ray Serve writes an access-log line per call in every deployment; the HTTP request's line comes
# from the ingress, so the deployments it calls (tokenizer pool, model and embedding replicas,
# the stop registry) write none by default: every line costs the serving path's core CPU, most
# of it in Ray forwarding each line to the driver's console (docs/performance.md, "The serving
# path's own lines and streams").
QUIET_CALLS = {"enable_access_log": False}


def _merge(defaults: dict[str, Any], user: DeploymentOptions) -> dict[str, Any]:
    options = dict(defaults)
    actor = dict(options.get("ray_actor_options", {}))
    actor["runtime_env"] = {"env_vars": dict(SERVE_FAST_PATH_ENV)}
    for key, value in user.serve_options().items():
        if key == "ray_actor_options":
            for k, v in value.items():
                if k == "resources":
                    actor["resources"] = {**actor.get("resources", {}), **v}
                elif k == "runtime_env":
                    env = {**actor["runtime_env"]["env_vars"], **(v.get("env_vars") or {})}
                    actor["runtime_env"] = {**v, "env_vars": env}
                else:
                    actor[k] = v
        elif key == "logging_config":
            options[key] = {**options.get(key, {}), **value}
        else:
            options[key] = value
    options["ray_actor_options"] = actor
    if options.get("autoscaling_config") or options.get("num_replicas") == "auto":
        # Ray Serve refuses a fixed replica count together with autoscaling
        if options.get("num_replicas") != "auto":
            options.pop("num_replicas", None)
    return options


PREFIX_ROUTER = "serve_app.routing.prefix_router:PrefixAwareRouter"


def model_replica_options(
    config: AppConfig,
    model_index: int = 0,
    cluster_resources: dict | None = None,
    role: str = "colocated",
) -> dict[str, Any]:
    """Options of a model replica deployment; role prefill / decode (inferMode dmi) take their
    overrides from Deployments.Prefill / Deployments.Decode, the same defaults otherwise."""
    model = config.BackendConfig.ModelDeployConfig.ModelConfig[model_index]
    device = _device(model.device, cluster_resources)
    actor: dict[str, Any] = {"num_cpus": AUTO}
    if device == "npu":
        actor["resources"] = {"NPU": 1}
    elif device == "cuda":
        actor["num_gpus"] = 1
    defaults = {
        "num_replicas": 1,
        # Requests queue inside the engine, where priorities and batching apply, not at the handle.
        "max_ongoing_requests": config.ServerConfig.maxLinkNum,
        "ray_actor_options": actor,
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        "logging_config": dict(QUIET_CALLS),
    }
    options = _merge(defaults, _user_options(config, role))
    world = model.world_size(role)
    if is_auto(options["ray_actor_options"]):
        # (given resources describe the node; else the live cluster's nodes are asked)
        nodes = [cluster_resources] if cluster_resources is not None else None
        ranks = _cpu_ranks(config, cluster_resources)
        options["ray_actor_options"]["num_cpus"] = auto_num_cpus(device, world, ranks, nodes)
    if world > 1 and "placement_group_bundles" not in options:
        # rank 0 is the replica (bundle 0), ranks 1.. are actors in the other bundles
        if "max_replicas_per_node" in options:
            raise ValueError(
                f"worldSize {world} places each replica's ranks with Ray Serve's "
                "placement_group_bundles, which Ray Serve refuses together with "
                "max_replicas_per_node: drop max_replicas_per_node"
            )
        options["placement_group_bundles"] = [_bundle(options["ray_actor_options"])] * world
        key = DEVICE_RESOURCE.get(device)
        # (asked of the live cluster when the app is built, not when resources are given; where
        # no running node has the device yet, as on a cluster that autoscales its device nodes,
        # Ray Serve waits for one)
        most = _most_per_node(key) if key and cluster_resources is None else None
        if most and world > most:
            raise ValueError(
                f"worldSize {world}: a replica's ranks are packed on one node, and no node of "
                f"this Ray cluster has more than {most:g} {key}: worldSize may be at most {most:g}"
            )
        options.setdefault("placement_group_strategy", "STRICT_PACK")
    schedule = config.BackendConfig.ScheduleConfig
    if role != "decode" and schedule.enablePrefixCaching:
        # a request goes to the replica that caches its prompt's prefix (routing/); a decode
        # replica's KV comes from the prefill, so decodes are spread as Ray Serve spreads them.
        # Each replica reports what it was sent every 2 s, for the other ingress replicas.
        options.setdefault("request_router_config", {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"block_size": schedule.cacheBlockSize},
            "request_routing_stats_period_s": 2,
        })  # fmt: skip
    if options.get("num_replicas") == "auto" or options.get("autoscaling_config"):
        # a replica runs maxBatchSize requests at once and queues the rest in its engine: scale
        # out when replicas hold more than that on average (Ray Serve's own default, 2, would
        # start a replica for every few requests)
        scaling = dict(options.get("autoscaling_config") or {})
        scaling.setdefault(
            "target_ongoing_requests", config.BackendConfig.ScheduleConfig.maxBatchSize
        )
        # the ingress replicas' handles report their load to the autoscaler every
        # metrics_interval_s (Ray Serve's default, 10 s, would let a decision lag a burst by as
        # much); below look_back_period_s, which Ray Serve requires
        from ray.serve.config import AutoscalingConfig

        default = AutoscalingConfig.model_fields["look_back_period_s"].default
        look_back = scaling.get("look_back_period_s", default)
        scaling.setdefault("metrics_interval_s", min(AUTOSCALING_REPORT_S, look_back / 2))
        options["autoscaling_config"] = scaling
    return options


def _device(device: str, cluster_resources: dict | None) -> str:
    return detect_accelerator(cluster_resources) if device == "auto" else device


def _user_options(config: AppConfig, role: str) -> DeploymentOptions:
    """The user's Deployments entry for a model replica of this role."""
    deployments = config.Deployments
    return {"colocated": deployments.ModelReplica, "prefill": deployments.Prefill,
            "decode": deployments.Decode}[role]  # fmt: skip


def _cpu_ranks(config: AppConfig, cluster_resources: dict | None) -> int:
    """The ranks of the app's model replicas on CPU, all deployments together (num_cpus auto
    splits a node's CPUs among them)."""
    roles = ("prefill", "decode") if config.pd_mode else ("colocated",)
    ranks = 0
    for model in config.BackendConfig.ModelDeployConfig.ModelConfig:
        if _device(model.device, cluster_resources) == "cpu":
            for role in roles:
                user = _user_options(config, role).serve_options()
                ranks += replicas_of({"num_replicas": 1, **user}) * model.world_size(role)
    return ranks


def _most_per_node(resource: str) -> float | None:
    """The most of `resource` one live node of the Ray cluster has (None: Ray is not up here)."""
    nodes = live_nodes()
    return None if nodes is None else max((n.get(resource, 0) for n in nodes), default=0)


def _bundle(actor: dict[str, Any]) -> dict[str, float]:
    """The Ray resources of one rank: the replica's own, as a placement group bundle."""
    # (Ray refuses an empty bundle: a replica asking for no core still holds a sliver of one)
    bundle = {"CPU": actor.get("num_cpus") or 0.01, **actor.get("resources", {})}
    if "num_gpus" in actor:
        bundle["GPU"] = actor["num_gpus"]
    return bundle


def tokenizer_pool_options(config: AppConfig) -> dict[str, Any]:
    defaults = {
        "num_replicas": config.BackendConfig.tokenizerProcessNumber,
        "max_ongoing_requests": config.ServerConfig.maxLinkNum,
        "ray_actor_options": {"num_cpus": 0},
        "logging_config": dict(QUIET_CALLS),
    }
    return _merge(defaults, config.Deployments.TokenizerPool)


def ingress_options(config: AppConfig) -> dict[str, Any]:
    limit, queue = admission_limits(config)
    defaults = {
        "num_replicas": 1,
        # MindIE's maxLinkNum running + twice as many queued is enforced inside each replica
        # (ingress/admission.py), which refuses in the family's envelope; Ray Serve's limits sit
        # above it so that overflow reaches the replica instead of Ray's plain-text 503.
        "max_ongoing_requests": 2 * (limit + queue),
        "max_queued_requests": limit,
        "ray_actor_options": {"num_cpus": 0},
    }
    return _merge(defaults, config.Deployments.Ingress)


def several_ingress_replicas(config: AppConfig) -> bool:
    """May the ingress run more than one replica (then stopInfer needs the shared registry)?"""
    ingress = config.Deployments.Ingress
    replicas = ingress.num_replicas
    return replicas == "auto" or bool(ingress.autoscaling_config) or (replicas or 1) > 1


def stop_registry_options(config: AppConfig) -> dict[str, Any]:
    """The shared StopRegistry: one replica, no CPU; every running request with an id holds
    one call open in it."""
    return {
        "num_replicas": 1,
        "max_ongoing_requests": 4 * config.ServerConfig.maxLinkNum + 64,
        "ray_actor_options": {
            "num_cpus": 0,
            "runtime_env": {"env_vars": dict(SERVE_FAST_PATH_ENV)},
        },
        "logging_config": dict(QUIET_CALLS),
    }


def admission_limits(config: AppConfig) -> tuple[int, int]:
    """(requests running, requests waiting) one ingress replica admits: maxLinkNum and twice
    as many, split over Deployments.Ingress.num_replicas (rounded up; autoscaled: not split)."""
    replicas = config.Deployments.Ingress.num_replicas
    link = config.ServerConfig.maxLinkNum
    limit = -(-link // replicas) if isinstance(replicas, int) and replicas > 0 else link
    return limit, 2 * limit


def embedding_replica_options(config: AppConfig) -> dict[str, Any]:
    """Options of an embedding deployment (any EmbeddingConfig[] item): one CPU by default,
    which Ray turns into the encoder's torch threads; Deployments.EmbeddingReplica over it."""
    defaults = {
        "num_replicas": 1,
        # Requests wait in the replica's micro-batcher, where concurrent ones share a pass.
        "max_ongoing_requests": config.ServerConfig.maxLinkNum,
        "ray_actor_options": {"num_cpus": 1},
        "logging_config": dict(QUIET_CALLS),
    }
    return _merge(defaults, config.Deployments.EmbeddingReplica)
