"""What the engine adds on Ascend NPUs: attention through torch_npu's fused operators
(`attention`)."""

from __future__ import annotations

from serve_app.engine.backends.base import Backend


class NPUBackend(Backend):
    """Attention through torch_npu's paged-attention operators, within their documented limits
    (checked before the model runs)."""

    def attention(self, kv_shape: tuple[int, int, int]) -> str:
        from serve_app.engine.backends.npu import attention

        block_size, _, head_size = kv_shape
        attention.check_limits(self.dtype, block_size, head_size)
        return attention.register()
