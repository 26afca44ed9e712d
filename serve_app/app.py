"""`build_app(args)`: the Ray Serve application (the import_path of deployments.yaml).

    Ingress (FastAPI) ──► TokenizerPool (N CPU replicas)
                     └──► ModelReplica  (one deployment per served model, accelerator-pinned)
    inferMode dmi:   └──► PrefillReplica ──(first token + KV)──► DecodeReplica  (per model)

Deployment classes are plain; only this builder decorates and binds them. `args` is the config
tree of serve_app/config.py (MindIE config.json names plus `Deployments` options); it is checked
here, before anything starts, so a bad key fails `serve run` / `serve deploy` at once.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppConfig, load_config

_ROLE_NAMES = {"both": "ModelReplica", "prefill": "PrefillReplica", "decode": "DecodeReplica"}


def replica_deployment_name(config: AppConfig, model_index: int, role: str = "both") -> str:
    models = config.BackendConfig.ModelDeployConfig.ModelConfig
    base = _ROLE_NAMES[role]
    return base if len(models) == 1 else f"{base}-{models[model_index].modelName}"


def build_app(args: dict[str, Any] | None = None):
    from ray import serve

    from serve_app.ingress.deployment import Ingress
    from serve_app.replica.model_replica import ModelReplica
    from serve_app.replica.options import (
        ingress_options,
        model_replica_options,
        tokenizer_pool_options,
    )
    from serve_app.tokenizer.pool import TokenizerPool

    config = load_config(dict(args or {}))
    plain = config.model_dump(mode="json")  # crosses to the replicas; each re-validates it
    pool = serve.deployment(TokenizerPool, name="TokenizerPool", **tokenizer_pool_options(config))
    # standard: one colocated replica deployment per model; dmi: a prefill and a decode
    # deployment per model, each with its own replica count, resources and KV pool.
    roles = ("prefill", "decode") if config.ServerConfig.inferMode == "dmi" else ("both",)
    replicas: dict[str, dict] = {role: {} for role in roles}
    names = []
    for i, model in enumerate(config.BackendConfig.ModelDeployConfig.ModelConfig):
        for role in roles:
            name = replica_deployment_name(config, i, role)
            options = model_replica_options(config, i, role=role)
            deployment = serve.deployment(ModelReplica, name=name, **options)
            replicas[role][model.modelName] = deployment.bind(plain, i, role)
            names.append(name)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", **ingress_options(config))
    return ingress.bind(pool.bind(plain), replicas, plain, names)
