"""Greedy sampling's argmax on CPU: torch's result, faster on the wide rows of a step's logits."""

from __future__ import annotations

import torch

from serve_app.engine.backends.cpu import kernels as cpu_kernels

_CHUNK = 128  # elements per chunk
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=1)` for a 2-D tensor, exactly (the first maximum; NaN counts as the
    largest), faster on CPU for wide rows, where torch's argmax runs many times slower than a max
    reduction (it does not vectorize). With the engine's CPU kernels: their `argmax_rows`
    (float32 or bfloat16). Else each row's chunk maxima (`amax`, which vectorizes), the first
    chunk holding the row's maximum, then argmax within that chunk (docs/performance.md, "What
    crosses and what attends")."""
    rows, width = x.shape
    if x.device.type != "cpu" or width < 8 * _CHUNK:
        return x.argmax(dim=1)
    if x.dtype in _KERNEL_DTYPES and x.stride(1) == 1:
        kernel = cpu_kernels.op("argmax_rows")
        if kernel is not None:
            return kernel(x)
    full = width - width % _CHUNK
    maxima = x[:, :full].view(rows, -1, _CHUNK).amax(dim=2)
    if full < width:  # the last, shorter chunk
        maxima = torch.cat([maxima, x[:, full:].amax(dim=1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=1) * _CHUNK
    # the winning chunk of each row; past the row's end (a short last chunk) the last element
    # repeats, after the real ones, so argmax's first maximum is still a real position
    window = (start[:, None] + torch.arange(_CHUNK, device=x.device)).clamp_(max=width - 1)
    return start + x.gather(1, window).argmax(dim=1)
