"""A split model's ranks on the strict fake torch_npu (not tests): `install()` puts, in the process
it runs in, the fake (test_npu_attention.FakeTorchNpu) where torch_npu would be, an "hccl"
process-group backend that is gloo underneath, the CPU's collectives named "hccl", and the NPU
attention backend into every model runner this process builds. The test installs it in its own
process (rank 0) and has the other ranks' processes run it before their life starts."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _hccl_on_gloo(store, rank, size, timeout):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install() -> None:
    import torch.distributed as dist
    import transformers.core_model_loading  # noqa: F401  (they probe for a real torch_npu
    import transformers.modeling_utils  # noqa: F401  once: before the fake is there)

    from serve_app.engine.backends import runner
    from serve_app.engine.backends.npu import attention as npu_attention
    from serve_app.engine.backends.parallel import group

    sys.path.insert(0, str(HERE))
    from test_npu_attention import FakeTorchNpu

    fake = FakeTorchNpu()
    fake.allow_float32 = True  # exact comparisons with the CPU engine, as `fake_npu` has it
    sys.modules["torch_npu"] = fake
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _hccl_on_gloo, devices=["cpu"])
    group.BACKENDS["cpu"] = "hccl"
    build = runner.ModelRunner.__init__

    def build_on_npu(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.model.set_attn_implementation(npu_attention.register())

    runner.ModelRunner.__init__ = build_on_npu


# what a rank's process runs instead of the plain start (local.START)
START = (
    f"import sys; sys.path.insert(0, {str(HERE)!r}); import fake_npu_ranks; "
    "fake_npu_ranks.install(); "
    "from serve_app.engine.backends.parallel.worker import _main; _main()"
)
