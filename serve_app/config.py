"""Application configuration: MindIE config.json names, checked once at load time.

Place in the request path: nothing runs per request here. `load_config` turns the Ray Serve
application `args` (or a YAML/JSON file) into a frozen `AppConfig` before any deployment starts;
the ingress reads `ServerConfig` (timeouts, limits), the tokenizer pool reads `BackendConfig`, and
each model replica hands `AppConfig.engine_config()` to the engine. Environment variables are read
here and nowhere else: today only the accelerator visibility that Ray sets (`accelerator_env`).

Keys and defaults follow MindIE Server's config.json (see reference/MINDIE.md). Our additions are
marked "(extension)" in their description.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve_app.deployment_options import DeploymentOptions, Deployments

if TYPE_CHECKING:
    from serve_app.engine.config import EngineConfig

_FROZEN = ConfigDict(extra="forbid", frozen=True)
_SCHED = "BackendConfig.ScheduleConfig"
_DEPLOY = "BackendConfig.ModelDeployConfig"


class ConfigError(ValueError):
    """The configuration cannot be loaded; the message lists every problem, one per line."""


def _cross_check(problems: list[str]) -> None:
    if problems:
        raise PydanticCustomError("cross_check", "{detail}", {"detail": "\n".join(problems)})


class ServerConfig(BaseModel):
    model_config = _FROZEN

    ipAddress: str = Field("127.0.0.1", description="Address the business port listens on.")
    port: int = Field(
        8000,
        ge=1,
        le=65535,
        description=(
            "Business (inference) port. Our default is 8000, Ray Serve's HTTP port; "
            "MindIE's is 1025."
        ),
    )
    managementPort: int = Field(1026, ge=1, le=65535, description="Management port.")
    metricsPort: int = Field(1027, ge=1, le=65535, description="Prometheus metrics port.")
    maxLinkNum: int = Field(
        1000,
        ge=1,
        le=4096,
        description=(
            "Requests served at once; twice as many more may queue, the rest are refused."
        ),
    )
    httpsEnabled: bool = Field(
        False,
        description=(
            "TLS on the business port. Default false (MindIE: true): we serve plain HTTP "
            "through Ray Serve; terminate TLS in front of it."
        ),
    )
    fullTextEnabled: bool = Field(False, description="Stream chunks carry the whole text so far.")
    inferMode: Literal["standard", "dmi"] = Field(
        "standard",
        description=(
            "standard: prefill and decode on one instance; dmi: prefill/decode separation."
        ),
    )
    interCommPort: int = Field(1121, ge=1, le=65535, description="Port for intra-cluster traffic.")
    openAiSupport: Literal["vllm"] = Field("vllm", description="OpenAI API dialect; only vllm.")
    tokenTimeout: int = Field(
        600,
        ge=1,
        le=3600,
        description=("Longest gap between two tokens of one request, in seconds."),
    )
    e2eTimeout: int = Field(600, ge=1, le=65535, description="Longest life of a request, seconds.")
    kvConnector: Literal["object_store"] = Field(
        "object_store",
        description=(
            "(extension) inferMode dmi: how KV moves from prefill to decode. object_store: "
            "staged on the host and moved through the Ray object store (works across nodes)."
        ),
    )
    kvLossPolicy: Literal["recompute", "fail"] = Field(
        "recompute",
        description=(
            "(extension) inferMode dmi: when a prefill's KV is lost before decode imports it "
            "(prefill replica died, object lost): recompute the prompt on the decode replica, or "
            "fail the request."
        ),
    )
    maxRequestLength: int = Field(40, ge=1, le=100, description="Largest request body, in MB.")

    @field_validator("ipAddress")
    @classmethod
    def _ip(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv4 or IPv6 address") from None
        return value


class ModelConfig(BaseModel):
    model_config = _FROZEN

    modelName: str = Field(
        "demo",
        min_length=1,
        max_length=256,
        description=(
            "Name clients send as `model`: letters, digits, '-', '.', '_', not starting or ending "
            "with '-', '.', '_'; at most 256 characters."
        ),
    )
    modelWeightPath: str = Field(
        "demo",
        min_length=1,
        description=(
            "Folder of Hugging Face safetensors weights, or 'demo' / 'demo-tiny' for the built-in "
            "demo model."
        ),
    )
    worldSize: int = Field(1, ge=1, description="Devices one model instance spans.")
    cpuMemSize: int = Field(5, ge=0, description="Host memory for swapped-out KV cache, in GB.")
    npuMemSize: float = Field(
        -1,
        description=(
            "KV cache per replica, in GB; -1 = auto (80% of free device memory, 2 GB on CPU)."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description=(
            "(extension) Weight and activation dtype; auto = the checkpoint's torch_dtype."
        ),
    )
    device: Literal["auto", "npu", "cuda", "cpu"] = Field(
        "auto",
        description=("(extension) Device to run on; auto = npu if present, else cuda, else cpu."),
    )
    trustRemoteCode: bool = Field(
        False,
        description=(
            "(extension) Allow model code shipped with the weights "
            "(transformers trust_remote_code)."
        ),
    )

    @field_validator("modelName")
    @classmethod
    def _name(cls, value: str) -> str:
        allowed = all(c.isascii() and (c.isalnum() or c in "-._") for c in value)
        if not allowed or value[0] in "-._" or value[-1] in "-._":
            raise ValueError(
                f"{value!r} must be letters, digits, '-', '.', '_' and must not "
                "start or end with '-', '.', '_'"
            )
        return value

    @field_validator("npuMemSize")
    @classmethod
    def _mem(cls, value: float) -> float:
        if value != -1 and value <= 0:
            raise ValueError(f"must be -1 (auto) or > 0 GB, got {value:g}")
        return value


_ModelConfig = ModelConfig  # the field below is named like the class; pydantic needs an alias


class ModelDeployConfig(BaseModel):
    model_config = _FROZEN

    maxSeqLen: int = Field(2560, ge=1, description="Longest sequence, prompt plus output, tokens.")
    maxInputTokenLen: int = Field(
        2048,
        ge=1,
        le=4194304,
        description=(
            "Longest prompt in tokens; the effective limit is min(maxInputTokenLen, maxSeqLen - 1)."
        ),
    )
    truncation: bool = Field(False, description="Too-long prompts: true = cut, false = reject.")
    ModelConfig: tuple[_ModelConfig, ...] = Field(
        (_ModelConfig(),),
        min_length=1,
        description=("Models served (at least one); the default is the built-in demo model."),
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
        _cross_check(problems)
        return self


class ScheduleConfig(BaseModel):
    model_config = _FROZEN

    templateType: Literal["Standard", "Mix"] = Field(
        "Standard",
        description=(
            "Standard: prefill and decode in separate steps; Mix: SplitFuse (ignored with dmi)."
        ),
    )
    cacheBlockSize: int = Field(128, ge=1, le=128, description="Tokens per KV cache block.")
    maxPrefillBatchSize: int = Field(50, ge=1, description="Most requests in one prefill step.")
    maxPrefillTokens: int = Field(8192, ge=1, description="Most prompt tokens in one prefill step.")
    prefillTimeMsPerReq: int = Field(
        150,
        ge=0,
        description=("Expected prefill time per request, ms (used by supportSelectBatch)."),
    )
    decodeTimeMsPerReq: int = Field(
        50, ge=0, description=("Expected decode time per request, ms (used by supportSelectBatch).")
    )
    prefillPolicyType: int = Field(
        0, ge=0, le=3, description=("Prefill queue policy: 0 FCFS, 1 STATE, 2 PRIORITY, 3 MLFQ.")
    )
    decodePolicyType: int = Field(
        0, ge=0, le=3, description=("Decode queue policy: 0 FCFS, 1 STATE, 2 PRIORITY, 3 MLFQ.")
    )
    maxBatchSize: int = Field(200, ge=1, le=5000, description="Most requests in one decode step.")
    maxIterTimes: int = Field(512, ge=1, description="Most tokens generated for one request.")
    maxPreemptCount: int = Field(
        0,
        ge=0,
        description=(
            "Most requests preempted (swapped to host memory) at once; > 0 needs cpuMemSize > 0."
        ),
    )
    supportSelectBatch: bool = Field(
        False, description=("Choose prefill or decode steps by the per-request time estimates.")
    )
    maxQueueDelayMicroseconds: int = Field(
        5000, ge=0, description=("Longest wait to fill a batch, in microseconds.")
    )
    maxFirstTokenWaitTime: int = Field(
        2500,
        ge=0,
        description=("Longest wait for a first token before prefill is favoured, in ms."),
    )
    kvCacheBlocks: int = Field(
        0,
        ge=0,
        description=(
            "(extension) KV pool size in blocks, used on CPU; 0 = derive from npuMemSize."
        ),
    )
    enablePrefixCaching: bool = Field(
        True, description=("(extension) Reuse KV cache blocks of identical prompt prefixes.")
    )

    @model_validator(mode="after")
    def _limits(self) -> ScheduleConfig:
        problems = [
            f"{_SCHED}.{key} ({value}) must be <= {_SCHED}.maxBatchSize ({self.maxBatchSize})"
            for key, value in (
                ("maxPrefillBatchSize", self.maxPrefillBatchSize),
                ("maxPreemptCount", self.maxPreemptCount),
            )
            if value > self.maxBatchSize
        ]
        _cross_check(problems)
        return self


_ModelDeployConfig, _ScheduleConfig = ModelDeployConfig, ScheduleConfig


class BackendConfig(BaseModel):
    model_config = _FROZEN

    npuDeviceIds: tuple[tuple[Annotated[int, Field(ge=0)], ...], ...] = Field(
        ((0,),), min_length=1, description="Logical device ids, one list per model instance."
    )
    tokenizerProcessNumber: int = Field(8, ge=1, le=32, description="Tokenizer processes.")
    multiNodesInferEnabled: bool = Field(False, description="One model instance spans nodes.")
    ModelDeployConfig: _ModelDeployConfig = Field(
        default_factory=_ModelDeployConfig, description="Sequence limits and the models served."
    )
    ScheduleConfig: _ScheduleConfig = Field(
        default_factory=_ScheduleConfig, description="Batching and KV cache scheduling."
    )

    @model_validator(mode="after")
    def _cross(self) -> BackendConfig:
        deploy, sched, problems = self.ModelDeployConfig, self.ScheduleConfig, []
        if sched.maxPrefillTokens < deploy.maxInputTokenLen:
            problems.append(
                f"{_SCHED}.maxPrefillTokens ({sched.maxPrefillTokens}) must be >= "
                f"{_DEPLOY}.maxInputTokenLen ({deploy.maxInputTokenLen})"
            )
        if sched.maxIterTimes > deploy.maxSeqLen:
            problems.append(
                f"{_SCHED}.maxIterTimes ({sched.maxIterTimes}) must be <= "
                f"{_DEPLOY}.maxSeqLen ({deploy.maxSeqLen})"
            )
        if sched.maxPreemptCount > 0:
            problems += [
                f"{_SCHED}.maxPreemptCount ({sched.maxPreemptCount}) > 0 requires "
                f"{_DEPLOY}.ModelConfig[{i}].cpuMemSize > 0 (got {model.cpuMemSize})"
                for i, model in enumerate(deploy.ModelConfig)
                if model.cpuMemSize <= 0
            ]
        _cross_check(problems)
        return self


_ServerConfig, _BackendConfig = ServerConfig, BackendConfig

_Deployments = Deployments


class AppConfig(BaseModel):
    """The whole application config: Ray Serve application `args`, MindIE config.json names."""

    model_config = _FROZEN

    ServerConfig: _ServerConfig = Field(
        default_factory=_ServerConfig, description="HTTP front end: address, limits, timeouts."
    )
    BackendConfig: _BackendConfig = Field(
        default_factory=_BackendConfig, description="Devices, models and scheduling."
    )
    Deployments: _Deployments = Field(
        default_factory=_Deployments,
        description="(extension) Ray Serve options per deployment: replicas, resources.",
    )

    def engine_config(self, model_index: int = 0) -> EngineConfig:
        """The frozen engine settings for ModelConfig[model_index]."""
        from serve_app.engine.config import EngineConfig

        deploy, sched = self.BackendConfig.ModelDeployConfig, self.BackendConfig.ScheduleConfig
        if not 0 <= model_index < len(deploy.ModelConfig):
            raise IndexError(f"{_DEPLOY}.ModelConfig has no item {model_index}")
        model = deploy.ModelConfig[model_index]
        config = EngineConfig(
            model=model.modelWeightPath,
            model_name=model.modelName,
            dtype=model.dtype,
            device=model.device,
            max_seq_len=deploy.maxSeqLen,
            max_input_token_len=deploy.maxInputTokenLen,
            truncation=deploy.truncation,
            max_iter_times=sched.maxIterTimes,
            max_batch_size=sched.maxBatchSize,
            max_prefill_batch_size=sched.maxPrefillBatchSize,
            max_prefill_tokens=sched.maxPrefillTokens,
            block_size=sched.cacheBlockSize,
            num_kv_blocks=sched.kvCacheBlocks,
            kv_cache_mem_gb=float(model.npuMemSize),
            enable_prefix_caching=sched.enablePrefixCaching,
            token_timeout_s=float(self.ServerConfig.tokenTimeout),
            e2e_timeout_s=float(self.ServerConfig.e2eTimeout),
        )
        config.check()
        return config


# Each section is a field named like its class, so the last name in a path names its class.
_SECTIONS = {
    c.__name__: c
    for c in (
        AppConfig,
        ServerConfig,
        BackendConfig,
        ModelDeployConfig,
        ModelConfig,
        ScheduleConfig,
        Deployments,
        DeploymentOptions,
    )
}
# Deployment sections are named after the deployment, not their class.
_SECTIONS.update(
    dict.fromkeys(
        ("Ingress", "TokenizerPool", "ModelReplica", "Prefill", "Decode"), DeploymentOptions
    )
)


def load_config(source: dict | str | Path | None = None) -> AppConfig:
    """Build the AppConfig from a dict (Ray Serve `args`), a YAML/JSON file path, or defaults."""
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
        return AppConfig.model_validate(data)
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


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def _describe(error: dict) -> str:
    loc, kind, path = tuple(error["loc"]), error["type"], _dotted(tuple(error["loc"]))
    if kind == "cross_check":
        return error["msg"].replace("\n", "\n  ")
    if kind == "extra_forbidden":
        key, parent = str(loc[-1]), _dotted(loc[:-1])
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
    message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    for words, sign in (("greater than or equal to", ">="), ("less than or equal to", "<=")):
        message = message.replace(words, sign)
    message = message.replace("Tuple should", "must").replace(" after validation", "")
    if kind == "model_type":
        message = "must be a mapping of keys"
    got = error.get("input")
    if kind != "value_error" and not isinstance(got, (dict, list)):
        message += f" (got {got!r})"
    return f"{path or '(top level)'}: {message}"


def accelerator_env() -> dict[str, str | None]:
    """The device visibility Ray set for this worker (it pins NPUs/GPUs through these)."""
    import os

    return {
        name: os.environ.get(name) for name in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    }
