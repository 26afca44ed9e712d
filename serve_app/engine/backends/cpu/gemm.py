"""Linear layers on CPU with their weights prepacked once for oneDNN, or streamed by our kernel.

A plain `nn.Linear` on CPU hands its weight to the GEMM library in row-major order on every call,
and the library re-blocks it each time. Reordering the weight once into oneDNN's own blocked
layout (what torch inductor's frozen CPU graphs and vLLM's CPU build do) removes that work from
every forward. `pack_linears(model)` swaps every `nn.Linear` of a loaded model for `linear()`'s
layer, holding only the packed weight (the row-major copy is dropped, so memory does not
double). Results match `nn.Linear` to float32 rounding (the kernels sum in another order; in
bfloat16 an output may differ from `nn.Linear`'s by one bfloat16 step where its float32 sum is
near a tie). Used on CPU for float32 and bfloat16 only; other devices and dtypes keep their
layers.

Where the engine's `streamed_linear` kernel is built (kernels.py: AVX-512, or AVX2 and FMA),
`linear()` gives a `StreamedLinear` instead of a `PackedLinear`, for the LM head, the fused decoder
layers' projections (layers.py) and any other Linear alike, in float32, and in bfloat16 except
on CPUs with AMX (`streams`). A decode step multiplies each weight by only a few dozen rows, and
the weights together are far larger than the caches, so oneDNN's GEMM waits for each weight about
as long as it computes; the streamed kernel overlaps the two and adds the bias and a residual or
product as it writes, and it can share a GEMM with helpers on spare cores, which oneDNN's
single-threaded call cannot. In bfloat16 on a CPU without bfloat16 arithmetic oneDNN runs at a
fraction of its float32 rate, or cannot prepack at all without AVX-512 (`onednn_packs`), while
the streamed kernel widens the weights to float32 in registers; with AVX512-BF16 it sums pairs of
products with the CPU's bfloat16 dot products (`bf16_pairs`), as oneDNN does. Where neither
takes bfloat16, transformers' own layers run (`supported` says no). What each choice measured,
per machine kind: docs/performance.md, "Packed and streamed GEMMs".
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.engine.backends.device import cpu_has_amx_bf16, cpu_has_fast_bf16

# The batch size oneDNN picks the blocked layout for; any batch size works with it.
BATCH_HINT = 32
PACKED_DTYPES = (torch.float32, torch.bfloat16)
_NONE, _ADD, _MUL, _SILU_MUL = 0, 1, 2, 3  # streamed_linear's epilogues


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `linear()` has a layer for this device and dtype: CPU, float32 or bfloat16, where
    oneDNN can prepack the dtype or the streamed kernel takes it."""
    return (
        device.type == "cpu" and dtype in PACKED_DTYPES and (onednn_packs(dtype) or streams(dtype))
    )


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN prepacks weights of this dtype on this CPU: its bfloat16
    path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and torch refuses it elsewhere (an AMD
    EPYC of the Zen 3 generation, say, has AVX2 only)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


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
    """y = x @ W^T + b, x [..., in_features] in W's dtype (float32 or bfloat16), W packed for
    cpu_kernels' streamed_linear: blocks of 32 output rows, each transposed
    ([blocks, in_features, 32]), zero-padded; in bfloat16 on a CPU with bfloat16 arithmetic
    (`bf16_pairs`), each two consecutive k of a block interleaved, column by column, for the
    kernel's pairwise dot products. The same fused forms as PackedLinear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = n, k = weight.shape
        self.kernel = cpu_kernels.op("streamed_linear")
        # filled block by block from the weight: no padded copy of the whole head on the way;
        # on 2 MiB pages where the OS gives them (csrc/huge_pages.cpp)
        zeros = cpu_kernels.op("zeros_on_huge_pages")
        self.packed = zeros([-(-n // 32), k, 32], weight.dtype)
        with torch.no_grad():
            whole = n // 32
            self.packed[:whole].copy_(weight[: whole * 32].view(whole, 32, k).transpose(1, 2))
            if n % 32:
                self.packed[whole, :, : n % 32].copy_(weight[whole * 32 :].t())
            if weight.dtype == torch.bfloat16 and bf16_pairs():
                _interleave_pairs(self.packed)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()

    def _apply_kernel(self, x: torch.Tensor, other=None, epilogue=_NONE) -> torch.Tensor:
        rows = x.reshape(math.prod(x.shape[:-1]), self.in_features)  # also when in_features is 0
        if other is not None:  # the kernel reads rows of other with a stride, columns side by side
            other = other.reshape(rows.shape[0], self.out_features)
            other = other if other.stride(-1) == 1 else other.contiguous()
        out = self.kernel(rows, self.packed, self.out_features, self.bias, other, epilogue)
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W^T + b), the activation in a second, vectorised pass (in bfloat16 the
        product is rounded before it, as transformers' own layer rounds)."""
        return F.silu(self._apply_kernel(x), inplace=True)

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """other + (x @ W^T + b), added as the kernel writes its output."""
        return self._apply_kernel(x, other, _ADD)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ W^T + b) * other, multiplied as the kernel writes its output."""
        return self._apply_kernel(x, other, _MUL)

    def mul_silu(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """(x @ W^T + b) * silu(gate), the activation computed as the kernel writes its output
        (a gated MLP's up projection times its gate: no pass of its own over the gate, and
        shared with the helpers like the GEMM). silu as transformers computes it, rounded to
        the dtype before the product as its own pass stores it; its exponential is the
        kernel's, within ~1.5 float32 ulps of the exact value (torch's: ~1.2)."""
        return self._apply_kernel(x, gate, _SILU_MUL)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, streamed"


def _interleave_pairs(packed: torch.Tensor, blocks_at_once: int = 256) -> None:
    """In place, [blocks, K, 32] -> each k-pair's 2 x 32 weights as 32 x 2 (column j's two at
    2j, 2j + 1); a last unpaired k (K odd) stays as it is. A few blocks at a time: no copy of a
    whole LM head on the way."""
    paired = packed.shape[1] // 2 * 2
    for start in range(0, packed.shape[0], blocks_at_once):
        part = packed[start : start + blocks_at_once, :paired]
        pairs = part.reshape(part.shape[0], paired // 2, 2, 32)
        part.copy_(pairs.transpose(2, 3).reshape(part.shape))


@functools.cache
def bf16_pairs() -> bool:
    """Whether the streamed kernel multiplies bfloat16 with the CPU's bfloat16 dot products
    (built with AVX512-BF16), on weights packed in pairs of k."""
    pairs = cpu_kernels.op("streamed_bf16_pairs")
    return pairs is not None and bool(pairs())


def streams(dtype: torch.dtype) -> bool:
    """Whether a layer of this dtype goes to the streamed kernel here, where it is built:
    float32; bfloat16 on a CPU without bfloat16 arithmetic (the kernel widens it to float32), and
    on one with AVX512-BF16 but no AMX, where the kernel uses the vector dot products (its pairs:
    as fast as oneDNN on one core, and shared with the spare cores' helpers). With AMX, oneDNN's
    tile GEMMs (not measured here)."""
    if cpu_kernels.op("streamed_linear") is None:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and (
        not cpu_has_fast_bf16() or (bf16_pairs() and not cpu_has_amx_bf16())
    )


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A CPU layer for `weight` (and `bias`) with forward, silu, add and mul: a StreamedLinear
    where `streams` says so, else a PackedLinear."""
    kind = StreamedLinear if streams(weight.dtype) else PackedLinear
    return kind(weight, bias)


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by `linear()`'s layer; how many were replaced.

    A Linear whose weight is shared with another module (a tied LM head) is replaced too: the
    other module keeps the shared tensor."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, linear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
