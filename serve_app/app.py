"""`build_app(args)`: the Ray Serve application (the import_path of deployments.yaml).

    Ingress (FastAPI) ──► TokenizerPool (N CPU replicas)
                     ├──► ModelReplica  (one deployment per served model, accelerator-pinned)
    inferMode dmi:   ├──► PrefillReplica ──(first token + KV)──► DecodeReplica  (per model)
                     └──► EmbeddingReplica  (one deployment per EmbeddingConfig[] endpoint, CPU)

Deployment classes are plain; only this builder decorates and binds them. `args` is the config
tree of serve_app/config/ (MindIE config.json names plus `Deployments` options); it is validated
here, once, before anything starts, so a bad key fails `serve run` / `serve deploy` at once, and
every deployment gets the frozen `AppConfig` itself (docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppConfig, load_config

_ROLE_NAMES = {
    "colocated": "ModelReplica", "prefill": "PrefillReplica", "decode": "DecodeReplica",
}  # fmt: skip


def replica_deployment_name(config: AppConfig, model_index: int, role: str = "colocated") -> str:
    models = config.BackendConfig.ModelDeployConfig.ModelConfig
    base = _ROLE_NAMES[role]
    return base if len(models) == 1 else f"{base}-{models[model_index].modelName}"


def embedding_deployment_name(config: AppConfig, index: int) -> str:
    endpoints = config.EmbeddingConfig
    base = "EmbeddingReplica"
    return base if len(endpoints) == 1 else f"{base}-{endpoints[index].endpointName}"


def build_app(args: dict[str, Any] | None = None):
    from ray import serve

    from serve_app.deployment_options import (
        embedding_replica_options,
        ingress_options,
        model_replica_options,
        several_ingress_replicas,
        stop_registry_options,
        tokenizer_pool_options,
    )
    from serve_app.ingress.deployment import Ingress
    from serve_app.replica.embedding_replica import EmbeddingReplica
    from serve_app.replica.model_replica import ModelReplica
    from serve_app.tokenizer.pool import TokenizerPool

    config = load_config(dict(args or {}))  # the one validation; deployments get this object
    pool = serve.deployment(TokenizerPool, name="TokenizerPool", **tokenizer_pool_options(config))
    # inferMode standard: one colocated replica deployment per model; dmi: a prefill and a
    # decode deployment per model, each with its own replica count, resources and KV pool.
    roles = ("prefill", "decode") if config.pd_mode else ("colocated",)
    replicas: dict[str, dict] = {role: {} for role in roles}
    names = []
    by_model: dict[str, list[str]] = {}
    for i, model in enumerate(config.BackendConfig.ModelDeployConfig.ModelConfig):
        for role in roles:
            name = replica_deployment_name(config, i, role)
            options = model_replica_options(config, i, role=role)
            deployment = serve.deployment(ModelReplica, name=name, **options)
            replicas[role][model.modelName] = deployment.bind(
                config, i, role, off_engine_cores=True
            )
            names.append(name)
            by_model.setdefault(model.modelName, []).append(name)
    # One CPU deployment per embedding endpoint; the ingress is ready once these are too.
    embedding = {}
    for i, endpoint in enumerate(config.embedding_names):
        name = embedding_deployment_name(config, i)
        options = embedding_replica_options(config)
        deployment = serve.deployment(EmbeddingReplica, name=name, **options)
        embedding[endpoint] = deployment.bind(config, i, off_engine_cores=True)
        names.append(name)
    # stopInfer may reach another ingress replica than its request: a registry they share
    stops = None
    if several_ingress_replicas(config):
        from serve_app.ingress.stops import StopRegistry

        options = stop_registry_options(config)
        stops = serve.deployment(StopRegistry, name="StopRegistry", **options).bind()
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", **ingress_options(config))
    pool_app = pool.bind(config, off_engine_cores=True)
    return ingress.bind(
        pool_app, replicas, config, names, embedding=embedding, stop_registry=stops,
        model_deployments=by_model,
    )  # fmt: skip
