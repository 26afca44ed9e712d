"""Paged attention for packed batches, plugged into transformers' AttentionInterface.

The model runs once per step over all scheduled tokens of all sequences, concatenated. Per-step
metadata (built once, used by every layer) says where each token's K/V goes in the paged cache
and which cached positions each query may see. Sequences with one new token (decodes) attend
over their gathered blocks in one batched call; prompt chunks are padded into a second batched
call, reading fresh K/V directly when no sequence has cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "serve_app_paged"


@dataclass(slots=True)
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # the first num_decodes tokens belong to one-token sequences
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L] True where a key may be seen
    prefill_index: torch.Tensor | None  # [Bp, Qmax] packed-token index (after the decodes)
    prefill_valid: torch.Tensor | None  # [Bp, Qmax] real (non-padding) query positions
    prefill_block_tables: torch.Tensor | None  # [Bp, max_blocks]; None: no cached context
    prefill_mask: torch.Tensor | None  # [Bp, 1, Qmax, L]
    # NPU backend extras (torch_npu kernels take lengths rather than masks)
    decode_context_lens: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[Bx, max_blocks] block ids -> [Bx, Hkv, max_blocks * block_size, D] keys or values."""
    return cache[block_tables].flatten(1, 2).transpose(1, 2)


def torch_paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    md: AttentionMetadata = kwargs["attn_metadata"]
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        keys = _gather(k_cache, md.decode_block_tables)
        values = _gather(v_cache, md.decode_block_tables)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),
            keys,
            values,
            attn_mask=md.decode_mask,
            scale=scaling,
            enable_gqa=True,
        )
        out[:nd] = o.squeeze(2)
    if md.prefill_index is not None:
        qp = q[nd:][md.prefill_index].transpose(1, 2)  # [Bp, H, Qmax, D]
        if md.prefill_block_tables is None:  # fresh prompts: their own K/V is all there is
            keys = k[nd:][md.prefill_index].transpose(1, 2)
            values = v[nd:][md.prefill_index].transpose(1, 2)
        else:
            keys = _gather(k_cache, md.prefill_block_tables)
            values = _gather(v_cache, md.prefill_block_tables)
        o = F.scaled_dot_product_attention(
            qp, keys, values, attn_mask=md.prefill_mask, scale=scaling, enable_gqa=True
        )
        out[nd:] = o.transpose(1, 2)[md.prefill_valid]
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None  # masking is the attention function's job (metadata), not transformers'


def register(name: str = ATTENTION_NAME, fn=torch_paged_attention) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_mask)
    return name
