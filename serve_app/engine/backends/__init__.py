"""The part of the engine that touches a device: the model runner and what each device adds.

`runner.ModelRunner` loads the model, owns the paged KV cache and runs a step's forward pass; it
is the same on every device. What differs lives in one sub-package per device: `cpu` (the
engine's own C++ kernels, fused decoder layers, packed GEMMs), `cuda` (a Triton decode kernel,
decode steps replayed as CUDA graphs) and `npu` (torch_npu's fused attention operators).
`attention` is the torch implementation every device falls back to, `metadata` what a step
tells each layer's attention, `device` how the device and the dtype are chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from serve_app.engine.backends.base import Backend
    from serve_app.engine.config import EngineConfig


def backend_for(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend of this device type (imported here: a process that only reads the light
    modules of this package imports no device code)."""
    if device.type == "cpu":
        from serve_app.engine.backends.cpu import CPUBackend as kind
    elif device.type == "cuda":
        from serve_app.engine.backends.cuda import CUDABackend as kind
    elif device.type == "npu":
        from serve_app.engine.backends.npu import NPUBackend as kind
    else:
        from serve_app.engine.backends.base import Backend as kind
    return kind(config, device, dtype)
