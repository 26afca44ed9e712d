"""Per-step attention metadata: built once from the scheduled batch, read by every layer.

Says where each new token's K/V goes in the paged cache (slot mapping) and which cached
positions each query may see (slots and masks for torch's sdpa; lengths and block tables for
the NPU kernels and the CPU kernel, which takes every token as a row of its own). The batch lists
one-token sequences (decodes) first, then prompt chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # the first num_decodes tokens belong to one-token sequences
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, L] True where a key may be seen
    prefill_index: torch.Tensor | None = None  # [Bp, Qmax] packed-token index (after decodes)
    prefill_valid: torch.Tensor | None = None  # [Bp, Qmax] real (non-padding) query positions
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks]; None: no cached context
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Qmax, L]
    # cache slot of every key position each sequence may read (padding reads a valid slot)
    decode_slots: torch.Tensor | None = None  # [Bd, L]
    prefill_slots: torch.Tensor | None = None  # [Bp, L]; None: no cached context
    # NPU backend extras (torch_npu kernels take lengths rather than masks)
    decode_context_lens: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    # a kernel reading decode keys/values in place (cpu_kernels, triton_attention): then no
    # decode_slots/mask; it takes decode_block_tables and decode_context_lens
    decode_kernel: Callable | None = None
    # with decode_kernel: every token as a query row of its own, over its sequence's cache up
    # to and including itself (the step's K/V is written before attention): a decode is one
    # row, a prompt chunk one per token; then no prefill index, mask or slots
    row_tables: torch.Tensor | None = None  # [T, max_blocks]
    row_lens: torch.Tensor | None = None  # [T]
    # prompt chunks all of one length, none with cached context: the packed tokens are the
    # batch as it is (no gather, no padding)
    prefill_dense: bool = False
    # prefill_mask as sdpa takes it: rows folded for grouped queries, additive, in the
    # queries' dtype; made by the first layer that needs it, reused by the others
    prefill_bias: torch.Tensor | None = None


def _block_tables(seqs, num_blocks: int, device: torch.device) -> torch.Tensor:
    rows = [s.block_table[:num_blocks] + [0] * (num_blocks - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _key_slots(tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slot of key positions 0..length-1 of each sequence: [B, length]."""
    positions = torch.arange(length, device=tables.device)
    return tables[:, positions // block_size] * block_size + positions % block_size


def build_metadata(
    seqs,
    num_new: list[int],
    kv_caches,
    block_size: int,
    device: torch.device,
    decode_kernel: Callable | None = None,
    prompt_rows: bool = True,
) -> AttentionMetadata:
    """Metadata for `seqs` (anything with num_computed_tokens and block_table), decodes first.
    With a decode_kernel, decodes attend through it (block tables and lengths) rather than over
    gathered slots under a mask, and with prompt_rows every prompt token too, as a row of its
    own (the CPU kernel); without, prompt chunks keep the masked path (on a GPU, where one
    batched sdpa call over a chunk beats re-reading the context once per token)."""
    size = block_size
    every_token = decode_kernel is not None and prompt_rows  # every token a kernel row

    def tensor(data):
        return torch.tensor(data, dtype=torch.long, device=device)

    slots: list[int] = []
    for seq, n in zip(seqs, num_new, strict=True):
        start = seq.num_computed_tokens
        table = seq.block_table
        slots.extend(table[p // size] * size + p % size for p in range(start, start + n))
    nd = sum(1 for n in num_new if n == 1)
    md = AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=tensor(slots),
        num_decodes=nd,
        decode_kernel=decode_kernel,
    )
    if nd:
        decodes = seqs[:nd]
        lengths = [s.num_computed_tokens + 1 for s in decodes]
        context = tensor(lengths)
        md.decode_block_tables = _block_tables(decodes, -(-max(lengths) // size), device)
        md.decode_context_lens = context
        if decode_kernel is None:
            md.decode_slots = _key_slots(md.decode_block_tables, max(lengths), size)
            keys = torch.arange(max(lengths), device=device)
            md.decode_mask = (keys[None, :] < context[:, None])[:, None, None, :]
    if every_token and seqs:
        first = [s.num_computed_tokens for s in seqs]
        ends = [f + n for f, n in zip(first, num_new, strict=True)]
        tables = _block_tables(seqs, -(-max(ends) // size), device)
        md.row_tables = tables.repeat_interleave(tensor(num_new), dim=0)
        rows = [torch.arange(f + 1, e + 1) for f, e in zip(first, ends, strict=True)]
        md.row_lens = torch.cat(rows).to(device)
    prompts, lens = seqs[nd:], num_new[nd:]
    if prompts and every_token:  # the lengths and tables the NPU kernels take
        first = [s.num_computed_tokens for s in prompts]
        md.prefill_query_lens = tensor(lens)
        md.prefill_context_lens = tensor([f + n for f, n in zip(first, lens, strict=True)])
        if any(first):
            longest = int(md.prefill_context_lens.max())
            md.prefill_block_tables = _block_tables(prompts, -(-longest // size), device)
    elif prompts:
        q_max = max(lens)
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        offsets = torch.arange(q_max)
        md.prefill_valid = (offsets[None, :] < torch.tensor(lens)[:, None]).to(device)
        index = (starts[:, None] + offsets[None, :]).clamp(max=sum(lens) - 1)
        md.prefill_index = index.to(device)
        first = tensor([s.num_computed_tokens for s in prompts])
        q_pos = first[:, None] + offsets.to(device)[None, :]  # absolute positions
        q_pos = torch.where(md.prefill_valid, q_pos, 0)  # padding sees key 0 only
        context = first + tensor(lens)
        md.prefill_query_lens = tensor(lens)
        md.prefill_context_lens = context
        cached = any(s.num_computed_tokens for s in prompts)
        md.prefill_dense = len(set(lens)) == 1 and not cached
        if cached:
            longest = max(s.num_computed_tokens + n for s, n in zip(prompts, lens, strict=True))
            md.prefill_block_tables = _block_tables(prompts, -(-longest // size), device)
            md.prefill_slots = _key_slots(md.prefill_block_tables, longest, size)
            keys = torch.arange(longest, device=device)
        else:
            keys = offsets.to(device)
        md.prefill_mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]
    return md
