"""Application configuration: MindIE config.json names, validated once, when the app is built.

Place in the request path: nothing runs per request here. `load_config` turns the Ray Serve
application `args` (or a YAML/JSON file) into a frozen `AppConfig` before any deployment starts;
`build_app` hands that object to every deployment: the ingress reads `ServerConfig` (timeouts,
limits), the tokenizer pool its token limits (`tokenizer.limits.TokenLimits.of`), each model replica
`AppConfig.engine_config()`, each embedding replica its `EmbeddingConfig[]` item. Keys and
defaults follow MindIE Server's config.json; our additions say "(extension)" in their
description. Every key declares whether it acts here, has no effect here (a warning when set) or
is refused (effects.py); docs/configuration.md is generated from all of it (reference.py).

    server.py       ServerConfig
    backend.py      BackendConfig: ModelDeployConfig (ModelConfig[]), ScheduleConfig
    model.py        ModelConfig: one model served
    embedding.py    EmbeddingConfig[]: embedding endpoints (extension)
    deployments.py  Deployments: Ray Serve options per deployment (extension)
    app.py          AppConfig, and what deployments derive from it
    loading.py      load_config, ConfigError
    effects.py      Section (every model's base): each key's status, refusals, warnings
    reference.py    docs/configuration.md, generated
"""

from serve_app.config.app import AppConfig, accelerator_env
from serve_app.config.backend import BackendConfig, ModelConfig, ModelDeployConfig, ScheduleConfig
from serve_app.config.deployments import DeploymentOptions, Deployments
from serve_app.config.embedding import EmbeddingConfig
from serve_app.config.loading import ConfigError, load_config
from serve_app.config.server import ServerConfig

__all__ = [
    "AppConfig",
    "BackendConfig",
    "ConfigError",
    "DeploymentOptions",
    "Deployments",
    "EmbeddingConfig",
    "ModelConfig",
    "ModelDeployConfig",
    "ScheduleConfig",
    "ServerConfig",
    "accelerator_env",
    "load_config",
]
