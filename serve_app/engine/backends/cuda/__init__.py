"""What the engine adds on CUDA: a Triton kernel for paged decode attention
(`triton_attention`) and decode steps replayed as CUDA graphs (`graphs`)."""

from __future__ import annotations

from serve_app.engine.backends.base import Backend
from serve_app.engine.backends.cuda import triton_attention


class CUDABackend(Backend):
    """Decodes attend through the Triton kernel, which reads lengths and block tables on the
    device: what lets a step of decodes replay as a CUDA graph. Prompt chunks keep one batched
    sdpa call (on a GPU that beats re-reading the context once per token)."""

    def __init__(self, config, device, dtype):
        super().__init__(config, device, dtype)
        if triton_attention.available():
            self.decode_kernel = triton_attention.paged_decode_attention

    def wants_decode_graphs(self) -> bool:
        """With the paged decode kernel (the graphs need its device-side lengths), unless
        enforceEager."""
        return self.decode_kernel is not None and not self.config.enforce_eager
