"""Paged attention for packed batches, plugged into transformers' AttentionInterface.

The model runs once per step over all scheduled tokens of all sequences, concatenated. Per-step
metadata (built once, used by every layer) says where each token's K/V goes in the paged cache
and which cached positions each query may see. Where the runner has a kernel that reads the
blocks in place (cpu_kernels, on CPU), every token attends through it: a decode over its
sequence's context, and each token of a prompt chunk, as a query row of its own, over its
sequence's cache up to and including itself (the chunk's K/V is written into the cache first).
On CUDA the decodes attend through the Triton kernel (triton_attention), which reads lengths
and tables on the device (what lets decode steps replay as CUDA graphs), and prompt chunks keep
the masked sdpa call below. Without a kernel, decodes attend over their gathered blocks in one
batched call, and prompt chunks are padded into a second batched call under a causal mask,
reading fresh K/V directly when no sequence has cached context.

On CPU the kernel beats torch's flash attention, which computes every key block under an
explicit mask (the causal half too) and, without AMX, multiplies bfloat16 through MKL's generic
path; the kernel skips the keys past each row, uses the CPU's bfloat16 dot products, and is
shared with the spare cores' helpers (docs/performance.md, "What crosses and what attends").
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from serve_app.engine.backends.metadata import AttentionMetadata, Prompts

ATTENTION_NAME = "serve_app_paged"
# sdpa's backends on CUDA, without cuDNN's: it builds an execution plan on the host for every
# new shape, and decoding has a new one every step (the context grows), so every decode step
# paid for planning until every length had been seen (docs/performance.md, "On a GPU").
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Keys or values at [Bx, L] slots -> [Bx, Hkv, L, D]. Token-granular: no padding to whole
    blocks, and index_select is several times faster than advanced indexing on CPU."""
    rows, length = slots.shape
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, slots.flatten())
    return flat.view(rows, length, *cache.shape[2:]).transpose(1, 2)


def _attend(q, k, v, mask, scale):
    """q [B, H, Q, D] over k/v [B, Hkv, L, D] -> [B, H, Q, D]; mask [B, 1, G * Q, L] (rows
    folded as the queries are, see below) or one that broadcasts to it.

    Grouped-query attention by folding each KV head's G query heads into the query axis (row
    g * Q + i is query i of head g): sdpa's own enable_gqa path is several times slower on CPU
    (ten times in bf16)."""
    batch, heads, num_q, dim = q.shape
    q = q.reshape(batch, k.shape[1], heads // k.shape[1] * num_q, dim)
    with sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # a copy only where the backend wrote another layout (CUDA's memory-efficient kernel)
    return out.reshape(batch, heads, num_q, dim)


def sdpa_backends(device: torch.device):
    """The sdpa backends this device's calls may use (a context): CUDA_BACKENDS on CUDA,
    torch's own choice elsewhere."""
    if device.type == "cuda":
        return sdpa_kernel(CUDA_BACKENDS)
    return contextlib.nullcontext()


def _prefill_bias(prompts: Prompts, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The step's prompt mask folded for `group` query heads per KV head and made additive
    (sdpa turns a boolean mask into this on every call): once per step, not once per layer."""
    if prompts.bias is None:
        mask = prompts.mask.repeat(1, 1, group, 1) if group > 1 else prompts.mask
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        prompts.bias = bias.masked_fill_(~mask, float("-inf"))
    return prompts.bias


def torch_paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    md: AttentionMetadata = kwargs["attn_metadata"]
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))
    scale = scaling if scaling is not None else head_dim**-0.5  # the kernels' (sdpa's default)
    if md.rows is not None:  # every token a query row of the kernel
        # q as the projection left it: the kernel reads strided rows
        out = md.decode_kernel(q, k_cache, v_cache, md.rows.tables, md.rows.lens, scale)
        return out.unsqueeze(0), None
    nd, decodes = md.num_decodes, md.decodes
    if nd and md.decode_kernel is not None:
        tables, lens = decodes.block_tables, decodes.context_lens
        decoded = md.decode_kernel(q[:nd], k_cache, v_cache, tables, lens, scale)
    elif nd:
        keys = _gather(k_cache, decodes.slots)
        values = _gather(v_cache, decodes.slots)
        decoded = _attend(q[:nd].unsqueeze(2), keys, values, decodes.mask, scaling).squeeze(2)
    if nd == q.shape[0]:  # decodes only: their output is the whole result
        return decoded.unsqueeze(0), None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decoded
    prompts = md.prompts
    bias = _prefill_bias(prompts, q.shape[1] // num_kv_heads, q.dtype)
    if prompts.dense:  # [Bp * Q, H, D] is [Bp, Q, H, D] as it stands
        num_q = prompts.mask.shape[2]
        qp, keys, values = (t[nd:].unflatten(0, (-1, num_q)).transpose(1, 2) for t in (q, k, v))
        out[nd:] = _attend(qp, keys, values, bias, scaling).transpose(1, 2).flatten(0, 1)
        return out.unsqueeze(0), None
    qp = q[nd:][prompts.index].transpose(1, 2)  # [Bp, H, Qmax, D]
    if prompts.slots is None:  # fresh prompts: their own K/V is all there is
        keys = k[nd:][prompts.index].transpose(1, 2)
        values = v[nd:][prompts.index].transpose(1, 2)
    else:
        keys = _gather(k_cache, prompts.slots)
        values = _gather(v_cache, prompts.slots)
    o = _attend(qp, keys, values, bias, scaling)
    out[nd:] = o.transpose(1, 2)[prompts.valid]
    return out.unsqueeze(0), None


def register(name: str = ATTENTION_NAME, fn=torch_paged_attention) -> str:
    """`fn` as transformers' attention `name`, with no mask function: masking is the attention
    function's job (the step's metadata), and for an attention without a mask function of its
    own transformers' mask builders return at once (with one, every forward went through their
    argument checks and a search for packed sequences in the positions, for a mask our
    attention never reads: docs/performance.md, "Fused layers and small ops")."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    return name
