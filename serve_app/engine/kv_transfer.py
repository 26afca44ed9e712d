"""A prompt's KV cache as a self-contained payload, for prefill/decode disaggregation.

The prefill engine gathers the prompt's keys and values out of its paged cache into per-layer
CPU tensors [num_tokens, num_kv_heads, head_dim]; the decode engine scatters them into blocks of
its own pool. The payload knows nothing of blocks, block size or device, so the two sides may
use different block sizes, pools and devices; only the model (layers, KV heads, head size) must
match. Both attention backends (`attention` on torch, `npu_attention` on Ascend) share the cache
layout `ModelRunner` allocates, [num_blocks, block_size, num_kv_heads, head_dim] per layer for
K and for V, so token t of a sequence lives at flat slot block_table[t // bs] * bs + t % bs in
either case, and one gather/scatter serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the payload's types import without torch (the ingress has none)
    import torch

    KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class KVPayload:
    num_tokens: int
    keys: list[torch.Tensor]  # per layer, CPU [num_tokens, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    dtype: torch.dtype
    read_ms: float = 0.0  # time the prefill engine spent gathering it to the host

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(slots=True)
class ImportedPrefill:
    """What a decode engine needs to continue a request another engine prefilled."""

    first_token_id: int
    kv: KVPayload | None  # None: recompute the prompt locally
    generator_state: torch.Tensor | None = None  # the seeded generator after the first token
    max_output_tokens: int = 0  # output tokens, the first included; 0: the engine's default


def token_slots(
    block_table: list[int], num_tokens: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """Flat cache slot of positions 0..num_tokens-1 of a sequence with this block table."""
    import torch

    need = -(-num_tokens // block_size)
    if need > len(block_table):
        raise ValueError(
            f"{num_tokens} tokens need {need} blocks; the table has {len(block_table)}"
        )
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table[:need], dtype=torch.long)
    return (blocks[positions // block_size] * block_size + positions % block_size).to(device)


def gather(caches: KVCaches, block_table: list[int], num_tokens: int, block_size: int):
    """The first num_tokens positions of a sequence, copied out of the paged cache to the host."""
    device = caches[0][0].device
    slots = token_slots(block_table, num_tokens, block_size, device)
    keys, values = [], []
    for k_cache, v_cache in caches:
        keys.append(k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots).cpu())
        values.append(v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots).cpu())
    return KVPayload(num_tokens, keys, values, caches[0][0].dtype)


def layout(caches: KVCaches) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of these caches."""
    return len(caches), *caches[0][0].shape[2:]


def check_layout(model: tuple[int, int, int], payload: KVPayload, num_tokens: int) -> None:
    """ValueError unless the payload holds num_tokens positions of a model whose KV is
    (layers, KV heads, head size) `model`."""
    layers = model[0]
    if payload.num_tokens != num_tokens:
        raise ValueError(f"the KV covers {payload.num_tokens} tokens, the prompt has {num_tokens}")
    if len(payload.keys) != layers or len(payload.values) != layers:
        raise ValueError(f"the KV payload has {len(payload.keys)} layers, this model has {layers}")
    expected = (num_tokens, *model[1:])
    for tensor in (*payload.keys, *payload.values):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"KV payload tensor {tuple(tensor.shape)} does not fit this model's {expected}"
            )


def scatter(caches: KVCaches, block_table: list[int], payload: KVPayload, block_size: int):
    """Write a payload into the paged cache at the first payload.num_tokens positions."""
    check_layout(layout(caches), payload, payload.num_tokens)
    device = caches[0][0].device
    slots = token_slots(block_table, payload.num_tokens, block_size, device)
    for (k_cache, v_cache), k, v in zip(caches, payload.keys, payload.values, strict=True):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(device, k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(device, v_cache.dtype))
