"""Frozen engine configuration: the only settings the engine reads, and the one home of their
defaults, choices and cross rules.

Two ways in: the served app's pydantic config (`serve_app.config`) takes its defaults,
dtype/device choices and cross rules from here and reports every broken one with its dotted path
while it loads, then `AppConfig.engine_config()` builds this object; `LLM(...)` builds it from
keyword overrides with `from_overrides`. Either way the object checks the same rules when it is
built, so an EngineConfig that exists is a valid one. Overrides accept our
snake_case names and MindIE's config.json names, so `LLM(model="demo", maxIterTimes=64)` reads
like a MindIE config.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serve_app.placement import format_cpus

DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: device.pick_dtype
DEVICES = ("auto", "npu", "cuda", "cpu")  # auto: npu if present, else cuda, else cpu

# Rules between settings, by MindIE name: (key, relation, other key).
CROSS_RULES = (
    ("maxPrefillTokens", ">=", "maxInputTokenLen"),  # the longest prompt fits one prefill step
    ("maxIterTimes", "<=", "maxSeqLen"),  # the output fits the sequence
    ("maxPrefillBatchSize", "<=", "maxBatchSize"),  # a prefill step is a batch
)
_RELATIONS = {">=": operator.ge, "<=": operator.le}
# Settings that count something, so must be at least 1 (the pydantic config states the same
# bounds on its fields, where they also document the schema).
_COUNTS = (
    "maxSeqLen",
    "maxInputTokenLen",
    "maxIterTimes",
    "maxBatchSize",
    "maxPrefillBatchSize",
    "maxPrefillTokens",
    "cacheBlockSize",
    "worldSize",
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "demo"  # modelWeightPath: a folder of HF weights, a hub id or a built-in name
    model_name: str = "demo"
    dtype: str = "auto"  # one of DTYPES
    device: str = "auto"  # one of DEVICES
    max_seq_len: int = 2560
    max_input_token_len: int = 2048
    truncation: bool = False
    max_iter_times: int = 512
    max_batch_size: int = 200
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    block_size: int = 128
    num_kv_blocks: int = 0  # 0: derive from kv_cache_mem_gb
    kv_cache_mem_gb: float = -1.0  # npuMemSize; -1: 80% of free device memory, 2 GiB on CPU
    enable_prefix_caching: bool = True
    token_timeout_s: float = 600.0  # longest gap between two tokens of one request
    e2e_timeout_s: float = 600.0  # longest life of one request
    seed: int = 0  # seed of the shared generator for requests without their own seed
    # AsyncEngine: the step loop in a child process of its own (host/process.py), bound to
    # these cores when given (its torch threads = their count), its CPU GEMMs helped by threads
    # on the spare cores at idle priority (csrc/spare_cores.h)
    engine_process: bool = False
    engine_cpus: tuple[int, ...] = ()
    engine_spare_cpus: tuple[int, ...] = ()
    # tensor parallelism: the model split over this many ranks, one device each (backends/parallel);
    # where they meet ("host:port" of rank 0; empty: rank 0 starts them as local processes)
    world_size: int = 1
    tp_rendezvous: str = ""
    # CUDA: decode steps run eagerly instead of replaying captured graphs (backends/cuda/graphs.py)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        found = problems(self.by_mindie_name())
        found += cpus_problems(self.engine_process, self.engine_cpus, self.engine_spare_cpus)
        if found:
            raise ValueError(found[0])  # the first broken rule, naming its keys

    @property
    def max_prompt_len(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_overrides(cls, model: str = "demo", **overrides) -> EngineConfig:
        """Build from keyword overrides; MindIE names are accepted."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict = {"model": model}
        for key, value in overrides.items():
            name = MINDIE_ALIASES.get(key, key)
            if name not in fields:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(fields)}")
            values[name] = value
        return cls(**values)

    def by_mindie_name(self) -> dict[str, Any]:
        values = {key: getattr(self, name) for key, name in MINDIE_ALIASES.items()}
        return {**values, "dtype": self.dtype, "device": self.device}


def cpus_problems(engine_process: bool, engine_cpus, spare_cpus=()) -> list[str]:
    """engineCpus binds the engine process and engineSpareCpus lends it helper threads, so both
    need one; a core is the engine's own or a spare one, not both (ModelConfig checks it too)."""
    found = []
    if engine_cpus and not engine_process:
        found.append("engineCpus needs engineProcess: true (it binds the engine process)")
    if spare_cpus and not engine_process:
        found.append("engineSpareCpus needs engineProcess: true (it lends the process cores)")
    both = set(engine_cpus) & set(spare_cpus)
    if both:
        found.append(
            f"engineSpareCpus {format_cpus(both)} are engineCpus too: spare cores are the cores "
            "the engine process is not bound to (those the serving path runs on)"
        )
    return found


def problems(
    values: Mapping[str, Any],
    path: Callable[[str], str] = str,
    rules: tuple[tuple[str, str, str], ...] = CROSS_RULES,
) -> list[str]:
    """Every broken rule among `values` (MindIE names; absent keys are not checked), worded
    with `path(key)`, so the app config can name its dotted paths."""
    found = [
        f"{path(key)} must be >= 1, got {values[key]}"
        for key in _COUNTS
        if key in values and values[key] < 1
    ]
    for key, choices in (("dtype", DTYPES), ("device", DEVICES)):
        if key in values and values[key] not in choices:
            found.append(f"{path(key)} must be {'|'.join(choices)}, got {values[key]!r}")
    for key, relation, other in rules:
        if key in values and other in values:
            if not _RELATIONS[relation](values[key], values[other]):
                found.append(
                    f"{path(key)} ({values[key]}) must be {relation} {path(other)} "
                    f"({values[other]})"
                )
    return found


# MindIE config.json key -> EngineConfig field.
MINDIE_ALIASES = {
    "modelWeightPath": "model",
    "modelName": "model_name",
    "maxSeqLen": "max_seq_len",
    "maxInputTokenLen": "max_input_token_len",
    "maxIterTimes": "max_iter_times",
    "maxBatchSize": "max_batch_size",
    "maxPrefillBatchSize": "max_prefill_batch_size",
    "maxPrefillTokens": "max_prefill_tokens",
    "cacheBlockSize": "block_size",
    "kvCacheBlocks": "num_kv_blocks",
    "npuMemSize": "kv_cache_mem_gb",
    "enablePrefixCaching": "enable_prefix_caching",
    "tokenTimeout": "token_timeout_s",
    "e2eTimeout": "e2e_timeout_s",
    "truncation": "truncation",
    "worldSize": "world_size",
}
