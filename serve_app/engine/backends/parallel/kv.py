"""A sequence's KV across the ranks: the PD hand-off moves the model's whole KV (every KV head),
so the prefill and the decode side may each have their own worldSize. Rank 0 gathers the
ranks' heads into one payload on export and hands each rank its heads on import."""

from __future__ import annotations

import torch

from serve_app.engine.backends.parallel.plan import Split
from serve_app.engine.kv_transfer import KVPayload


def merge(parts: list[KVPayload], splits: list[Split]) -> KVPayload:
    """The ranks' payloads (in rank order) as one, each KV head once (where ranks share a KV
    head, the first rank's copy)."""
    chosen, seen = [], set()
    for part, split in zip(parts, splits, strict=True):
        if split.kv_head_start not in seen:
            seen.add(split.kv_head_start)
            chosen.append(part)
    if len(chosen) == 1:
        return chosen[0]
    first = chosen[0]
    keys = [torch.cat(layer, dim=1) for layer in zip(*(p.keys for p in chosen), strict=True)]
    values = [torch.cat(layer, dim=1) for layer in zip(*(p.values for p in chosen), strict=True)]
    read_ms = max(p.read_ms for p in chosen)
    return KVPayload(first.num_tokens, keys, values, first.dtype, read_ms)


def part(payload: KVPayload, split: Split) -> KVPayload:
    """The heads of `payload` (every KV head of the model) that `split`'s rank holds."""
    heads = slice(split.kv_head_start, split.kv_head_start + split.kv_heads)
    return KVPayload(
        payload.num_tokens,
        [k[:, heads] for k in payload.keys],
        [v[:, heads] for v in payload.values],
        payload.dtype,
        payload.read_ms,
    )
