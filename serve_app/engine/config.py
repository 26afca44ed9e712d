"""Frozen engine configuration: the only settings the engine reads.

Built once from the pydantic app config (`serve_app.config`) or from keyword overrides given to
`LLM(...)`. Overrides accept our snake_case names and the MindIE config.json names (camelCase),
so `LLM(model="demo", maxIterTimes=64)` reads like a MindIE config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "demo"  # modelWeightPath: a folder of HF weights, or "demo" / "demo-tiny"
    model_name: str = "demo"
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto | npu | cuda | cpu
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

    @property
    def max_prompt_len(self) -> int:
        return min(self.max_input_token_len, self.max_seq_len - 1)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_overrides(cls, model: str = "demo", **overrides) -> EngineConfig:
        """Build from keyword overrides; MindIE names are accepted as aliases."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict = {"model": model}
        for key, value in overrides.items():
            name = MINDIE_ALIASES.get(key, key)
            if name not in fields:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(fields)}")
            values[name] = value
        config = cls(**values)
        config.check()
        return config

    def check(self) -> None:
        """The MindIE load-time cross checks, raised as ValueError naming the keys."""
        positive = {
            "maxSeqLen": self.max_seq_len,
            "maxInputTokenLen": self.max_input_token_len,
            "maxIterTimes": self.max_iter_times,
            "maxBatchSize": self.max_batch_size,
            "maxPrefillBatchSize": self.max_prefill_batch_size,
            "maxPrefillTokens": self.max_prefill_tokens,
            "cacheBlockSize": self.block_size,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.max_prefill_tokens < self.max_input_token_len:
            raise ValueError(
                f"maxPrefillTokens ({self.max_prefill_tokens}) must be >= maxInputTokenLen "
                f"({self.max_input_token_len})"
            )
        if self.max_iter_times > self.max_seq_len:
            raise ValueError(
                f"maxIterTimes ({self.max_iter_times}) must be <= maxSeqLen ({self.max_seq_len})"
            )
        if self.max_prefill_batch_size > self.max_batch_size:
            raise ValueError(
                f"maxPrefillBatchSize ({self.max_prefill_batch_size}) must be <= maxBatchSize "
                f"({self.max_batch_size})"
            )
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto|bfloat16|float16|float32, got {self.dtype!r}")
        if self.device not in ("auto", "npu", "cuda", "cpu"):
            raise ValueError(f"device must be auto|npu|cuda|cpu, got {self.device!r}")


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
}
