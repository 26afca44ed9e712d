"""Linear layers on CPU with their weights prepacked once for oneDNN.

A plain `nn.Linear` on CPU hands its weight to the GEMM library in row-major order on every call,
and the library re-blocks it each time. Reordering the weight once into oneDNN's own blocked
layout (what torch inductor's frozen CPU graphs and vLLM's CPU build do) removes that work from
every forward: measured on this project's 2-core AMD EPYC (AVX-512 with BF16), the 151936 x 512
LM head at batch 32 went from 91 ms to 30 ms in float32 and from 22 ms to 15 ms in bfloat16,
and at batch 1 from 37 ms to 17 ms (float32) and 11 ms to 7 ms (bfloat16), with 2 threads.

`pack_linears(model)` swaps every `nn.Linear` of a loaded model for a `PackedLinear` holding
only the packed weight (the row-major copy is dropped, so memory does not double). Results
match `nn.Linear` to float32 rounding (the blocked kernel sums in another order; bfloat16 is
bit-identical here). Used on CPU for float32 and bfloat16 only; other devices and dtypes keep
their layers.

The LM head is the exception where the engine's `streamed_linear` kernel is built
(cpu_kernels.py, AVX-512 CPUs): its weight is far larger than any cache (311 MB in float32 on
the demo model) and a step multiplies it by only a few dozen rows, so oneDNN's GEMM waits for
the weight about as long as it computes. `lm_head(weight)` gives a `StreamedLinear` there, which
overlaps the two: on a 2-core Xeon the demo's head at 32 rows took 20.6 ms instead of 25.5 in
float32. In bfloat16 it is used on CPUs without bfloat16 arithmetic (no AVX512-BF16 or AMX),
where oneDNN's bfloat16 GEMM runs at a quarter of its float32 rate and the streamed kernel, which
widens the weights to float32 in registers, took 21.6 ms instead of 93.6.
"""

from __future__ import annotations

import torch
from torch import nn

from serve_app.engine import cpu_kernels
from serve_app.engine.device import cpu_has_fast_bf16

# The batch size oneDNN picks the blocked layout for; any batch size works with it.
BATCH_HINT = 32
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacked linears apply: CPU, float32 or bfloat16, a torch built with oneDNN."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's blocked layout; x may have any leading dims."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W^T + b), the activation applied by the GEMM as it writes its output."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [None], "")

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other + (x @ W^T + b) in one pass (a residual add fused into the GEMM)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W^T + b) * other in one pass."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class StreamedLinear(nn.Module):
    """y = x @ W^T, x [..., in_features] in W's dtype (float32 or bfloat16), W packed for
    cpu_kernels' streamed_linear: blocks of 32 output rows, each transposed
    ([blocks, in_features, 32]), zero-padded."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = n, k = weight.shape
        self.kernel = cpu_kernels.op("streamed_linear")
        # filled block by block from the weight: no padded copy of the whole head on the way
        self.packed = weight.new_zeros(-(-n // 32), k, 32)
        with torch.no_grad():
            whole = n // 32
            self.packed[:whole].copy_(weight[: whole * 32].view(whole, 32, k).transpose(1, 2))
            if n % 32:
                self.packed[whole, :, : n % 32].copy_(weight[whole * 32 :].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.kernel(rows, self.packed, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, streamed"


def streams(dtype: torch.dtype) -> bool:
    """Whether an LM head of this dtype goes to the streamed kernel here: float32, or bfloat16
    on a CPU without bfloat16 arithmetic, where the kernel is built."""
    wanted = dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_has_fast_bf16())
    return wanted and cpu_kernels.op("streamed_linear") is not None


def lm_head(weight: torch.Tensor) -> nn.Module:
    """The LM head's layer for a bias-free `weight`: a StreamedLinear where `streams` says so,
    else a PackedLinear."""
    return StreamedLinear(weight) if streams(weight.dtype) else PackedLinear(weight)


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`; how many were replaced.

    A Linear whose weight is shared with another module (a tied LM head) is replaced too: the
    other module keeps the shared tensor."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
