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
class Decodes:
    """The step's one-token sequences (its first tokens)."""

    block_tables: torch.Tensor  # [Bd, max_blocks]
    context_lens: torch.Tensor  # [Bd] keys each may see, its own new one included
    # without a decode kernel: the cache slot of every key position each may read (padding
    # reads a valid slot), and which of them it may see
    slots: torch.Tensor | None = None  # [Bd, L]
    mask: torch.Tensor | None = None  # [Bd, 1, 1, L]


@dataclass(slots=True)
class Prompts:
    """The step's prompt chunks (after the decodes)."""

    query_lens: torch.Tensor  # [Bp] new tokens of each chunk
    context_lens: torch.Tensor  # [Bp] cached tokens before the chunk plus the chunk
    block_tables: torch.Tensor | None = None  # [Bp, max_blocks]; None: no cached context
    # the masked sdpa path (no kernel rows): the chunks padded into one batch
    index: torch.Tensor | None = None  # [Bp, Qmax] packed-token index (after decodes)
    valid: torch.Tensor | None = None  # [Bp, Qmax] real (non-padding) query positions
    mask: torch.Tensor | None = None  # [Bp, 1, Qmax, L]
    slots: torch.Tensor | None = None  # [Bp, L] key slots; None: no cached context
    # chunks all of one length, none with cached context: the packed tokens are the batch as
    # it is (no gather, no padding)
    dense: bool = False
    # mask as sdpa takes it: rows folded for grouped queries, additive, in the queries' dtype;
    # made by the first layer that needs it, reused by the others
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class KernelRows:
    """Every new token as a query row of the decode kernel, over its sequence's cache up to and
    including itself (the step's K/V is written before attention): a decode is one row, a
    prompt chunk one per token."""

    tables: torch.Tensor  # [T, max_blocks]
    lens: torch.Tensor  # [T]


@dataclass(slots=True)
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # the first num_decodes tokens belong to one-token sequences
    # a kernel reading decode keys/values in place (the CPU kernels, the Triton one): then the
    # decodes have no slots or mask
    decode_kernel: Callable | None = None
    decodes: Decodes | None = None
    prompts: Prompts | None = None
    rows: KernelRows | None = None  # with decode_kernel, where prompts are kernel rows too


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
        tables = _block_tables(decodes, -(-max(lengths) // size), device)
        md.decodes = Decodes(tables, context)
        if decode_kernel is None:
            md.decodes.slots = _key_slots(tables, max(lengths), size)
            keys = torch.arange(max(lengths), device=device)
            md.decodes.mask = (keys[None, :] < context[:, None])[:, None, None, :]
    if every_token and seqs:
        first = [s.num_computed_tokens for s in seqs]
        ends = [f + n for f, n in zip(first, num_new, strict=True)]
        tables = _block_tables(seqs, -(-max(ends) // size), device)
        rows = [torch.arange(f + 1, e + 1) for f, e in zip(first, ends, strict=True)]
        md.rows = KernelRows(
            tables.repeat_interleave(tensor(num_new), dim=0), torch.cat(rows).to(device)
        )
    prompts, lens = seqs[nd:], num_new[nd:]
    if prompts and every_token:  # the lengths and tables the NPU kernels take
        first = [s.num_computed_tokens for s in prompts]
        md.prompts = Prompts(
            tensor(lens), tensor([f + n for f, n in zip(first, lens, strict=True)])
        )
        if any(first):
            longest = int(md.prompts.context_lens.max())
            md.prompts.block_tables = _block_tables(prompts, -(-longest // size), device)
    elif prompts:
        q_max = max(lens)
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        offsets = torch.arange(q_max)
        first = tensor([s.num_computed_tokens for s in prompts])
        part = md.prompts = Prompts(tensor(lens), first + tensor(lens))
        part.valid = (offsets[None, :] < torch.tensor(lens)[:, None]).to(device)
        index = (starts[:, None] + offsets[None, :]).clamp(max=sum(lens) - 1)
        part.index = index.to(device)
        q_pos = first[:, None] + offsets.to(device)[None, :]  # absolute positions
        q_pos = torch.where(part.valid, q_pos, 0)  # padding sees key 0 only
        cached = any(s.num_computed_tokens for s in prompts)
        part.dense = len(set(lens)) == 1 and not cached
        if cached:
            longest = max(s.num_computed_tokens + n for s, n in zip(prompts, lens, strict=True))
            part.block_tables = _block_tables(prompts, -(-longest // size), device)
            part.slots = _key_slots(part.block_tables, longest, size)
            keys = torch.arange(longest, device=device)
        else:
            keys = offsets.to(device)
        part.mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]
    return md
