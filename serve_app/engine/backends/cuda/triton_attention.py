"""Decode attention over the paged KV cache in one Triton kernel (CUDA and other Triton GPUs).

Each decoding sequence's query (one token, every head) attends over its own cached keys and
values, read in place through its block table: no gather of the context into a padded batch and
no mask, one launch per layer whatever the lengths. The lengths and tables are read on the
device, so a step's launch has the same shape from step to step, which is what lets a decode
step be replayed as a CUDA graph (`cuda_graphs`). The same call as the CPU kernel's
(`cpu_kernels.paged_decode_attention`): q [rows, H, D] (any row and head strides), the caches
[blocks, block_size, Hkv, D], tables [rows, max_blocks], lens [rows], a scale; out [rows, H, D].

Each program is one (row, head): its query against BLOCK_N keys at a time, softmax kept online
in float32 (running max and sum), the grouped query heads of one KV head reading the same pages
from cache.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

tl = None  # triton.language, imported by _kernel(): the kernel's body refers to it as a global

BLOCK_N = 32  # keys per iteration


def _paged_decode(
    Q, K, V, Out, Tables, Lens, scale,
    stride_qr, stride_qh, stride_or, stride_oh, stride_tr, stride_kb, stride_ks, stride_kh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, DIM_P2)
    in_dim = dims < HEAD_DIM
    q = tl.load(Q + row * stride_qr + head * stride_qh + dims, mask=in_dim, other=0.0)
    q = q.to(tl.float32) * scale
    length = tl.load(Lens + row)
    offsets = tl.arange(0, BLOCK_N)
    # running max and sum as 0-d float32 tensors, the accumulator as a vector
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([DIM_P2], tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + offsets
        valid = pos < length
        block = tl.load(Tables + row * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0)
        base = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        where = base[:, None] + dims[None, :]
        both = valid[:, None] & in_dim[None, :]
        k = tl.load(K + where, mask=both, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], 1)
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(V + where, mask=both, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        total = total * alpha + tl.sum(p, 0)
        m = m_new
    out = (acc / total).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_or + head * stride_oh + dims, out, mask=in_dim)


@functools.cache
def _kernel():
    """The kernel, compiled on first use (importing this module needs neither a GPU nor
    Triton). Under TRITON_INTERPRET=1, set before Triton is first imported, triton.jit gives
    Triton's interpreter instead, which runs it on CPU tensors: the tests' way in."""
    global tl
    import triton
    import triton.language as tl

    return triton.jit(_paged_decode)


def available() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA builds); not imported here,
    which takes a few hundred milliseconds that a CPU engine does not need to spend."""
    return importlib.util.find_spec("triton") is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Row r (q[r], every head) over the first lens[r] positions of its sequence's cache,
    whose blocks are tables[r]; returns [rows, H, D] in q's dtype."""
    rows, heads, dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    _kernel()[(rows, heads)](
        q, k_cache, v_cache, out, tables, lens, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        heads // kv_heads, block_size, dim, 1 << (dim - 1).bit_length(), BLOCK_N,
    )  # fmt: skip
    return out
