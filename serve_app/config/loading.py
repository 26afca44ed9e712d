"""`load_config`: Ray Serve `args`, a YAML/JSON file or nothing -> a validated, frozen AppConfig,
or one `ConfigError` listing every problem with its dotted path (refused values among them); a
key the user set that has no effect here is logged as one warning line per load
(`serve_app.config.effects`)."""

from __future__ import annotations

import difflib
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from serve_app.config.app import AppConfig
from serve_app.config.backend import (
    BackendConfig,
    ModelConfig,
    ModelDeployConfig,
    ScheduleConfig,
)
from serve_app.config.deployments import DeploymentOptions, Deployments
from serve_app.config.effects import no_effect_warnings
from serve_app.config.embedding import EmbeddingConfig
from serve_app.config.server import ServerConfig
from serve_app.pydantic_errors import dotted, reword

logger = logging.getLogger("serve_app.config")


class ConfigError(ValueError):
    """The configuration cannot be loaded; the message lists every problem, one per line."""


_SECTIONS = {
    c.__name__: c
    for c in (
        AppConfig,
        ServerConfig,
        BackendConfig,
        ModelDeployConfig,
        ModelConfig,
        ScheduleConfig,
        EmbeddingConfig,
        Deployments,
        DeploymentOptions,
    )
}
# Deployment sections are named after the deployment, not their class.
_SECTIONS.update(
    dict.fromkeys(
        ("Ingress", "TokenizerPool", "ModelReplica", "Prefill", "Decode", "EmbeddingReplica"),
        DeploymentOptions,
    )
)


API_KEYS_ENV = "SERVE_APP_API_KEYS"


def load_config(source: dict | str | Path | None = None, warn: bool = True) -> AppConfig:
    """Build the AppConfig from a dict (Ray Serve `args`), a YAML/JSON file path, or defaults;
    `warn`: log a line for each key set that has no effect here (a check that loads the config
    again later passes False, so that each line is logged once)."""
    if source is None:
        data: Any = {}
    elif isinstance(source, dict):
        data = source
    elif isinstance(source, (str, Path)):
        data = _read_file(Path(source))
    else:
        raise ConfigError(f"config must be a dict, a path or None, not {type(source).__name__}")
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    try:
        config = AppConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        failed = {error["loc"][:i] for error in errors for i in range(len(error["loc"]))}
        # pydantic also calls a sequence "too short" when one of its items failed: noise
        lines = [
            _describe(error)
            for error in errors
            if not (error["type"] == "too_short" and error["loc"] in failed)
        ]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
    loaded = _with_env_keys(config)  # may still fail: warn only about a config that loads
    # read from the config as written, before the environment's API keys join it
    for line in no_effect_warnings(config) if warn else ():
        logger.warning(line)
    return loaded


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from None
    return {} if data is None else data


def _describe(error: dict) -> str:
    loc, kind, path = tuple(error["loc"]), error["type"], dotted(error["loc"])
    if kind == "cross_check":
        return error["msg"].replace("\n", "\n  ")
    if kind == "extra_forbidden":
        key, parent = str(loc[-1]), dotted(loc[:-1])
        where = f"in {parent}" if parent else "at the top level"
        section = next((p for p in reversed(loc[:-1]) if isinstance(p, str)), "AppConfig")
        known = list(_SECTIONS[section].model_fields) if section in _SECTIONS else []
        close = difflib.get_close_matches(key, known, n=1)
        hint = (
            f" (did you mean {close[0]!r}?)"
            if close
            else (f" (known keys: {', '.join(known)})" if known else "")
        )
        return f"{path}: unknown key {key!r} {where}{hint}"
    message = reword(error["msg"])
    if kind == "model_type":
        message = "must be a mapping of keys"
    got = error.get("input")
    if kind != "value_error" and not isinstance(got, (dict, list)):
        message += f" (got {got!r})"
    return f"{path or '(top level)'}: {message}"


def _with_env_keys(config: AppConfig) -> AppConfig:
    """The config with the API keys of SERVE_APP_API_KEYS (comma-separated) added to
    ServerConfig.apiKeys. Read where the app is built (`serve run`, `python -m serve_app`, the
    process that runs build_app), and carried to the ingress replicas inside the frozen config,
    so no other node needs the variable."""
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if not keys:
        return config
    if any(any(c.isspace() for c in key) for key in keys):
        raise ConfigError(f"{API_KEYS_ENV}: a key may not contain spaces")
    server = config.ServerConfig
    merged = tuple(server.apiKeys) + tuple(SecretStr(key) for key in keys)
    return config.model_copy(update={"ServerConfig": server.model_copy(update={"apiKeys": merged})})
