"""The device backend's interface, and its plain form: torch alone, on any device.

A `Backend` answers the model runner's device questions: which attention the model's layers call,
what it does to a loaded model (fused layers, packed weights), how the paged KV cache is
allocated and how large it may be, whether decode steps are captured as graphs, and the argmax
greedy sampling uses. One object per runner (`backends.backend_for`); the runner itself is the
same on every device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from serve_app.engine.backends import attention
from serve_app.engine.backends.device import free_memory_bytes
from serve_app.engine.config import EngineConfig


class Backend:
    """Torch alone: attention through sdpa over gathered K/V under masks (`attention`), the
    model's own layers, every step eager."""

    # decode attention that reads the paged cache in place (q, k_cache, v_cache, block tables,
    # lengths, scale) -> out, or None: decodes attend over their gathered K/V under a mask
    decode_kernel: Callable | None = None
    # with a decode_kernel: each prompt token attends through it too, as a row of its own over
    # its sequence's cache; otherwise prompt chunks take one masked sdpa call
    prompt_rows: bool = False

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

    def attention(self, kv_shape: tuple[int, int, int]) -> str:
        """Register the attention the model's layers call; its name for
        `set_attn_implementation`. kv_shape: (block size, KV heads, head size)."""
        return attention.register()

    def prepare(self, model: torch.nn.Module, lm_head: torch.nn.Linear | None):
        """Adapt the loaded model to the device (in place); returns the LM head the runner
        applies (None: the model's own forward computes the logits)."""
        return lm_head

    def kv_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One K or V tensor of the paged cache, zeroed and held from the start (or by
        `hold_kv`)."""
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def hold_kv(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The whole cache is allocated: where kv_zeros left its memory to be allocated as it
        is written, have it allocated (in the background: backends/cpu/commit.py)."""

    def kv_budget_bytes(self) -> int:
        """Memory the KV pool may take when the config sizes it by neither blocks nor GB."""
        return int(0.8 * free_memory_bytes(self.device))

    def wants_decode_graphs(self) -> bool:
        """Whether decode steps replay as captured graphs (cuda/graphs.py)."""
        return False

    def stats(self) -> dict[str, int]:
        """The backend's own counters, reported among the engine's."""
        return {}

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`x.argmax(dim=1)` of a 2-D tensor (greedy sampling), exactly."""
        return x.argmax(dim=1)
