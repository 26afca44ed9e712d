"""Decode steps replayed as CUDA graphs, one graph per padded batch size.

A decode step of a 1B model in eager mode is hundreds of small kernel launches, and on a GPU the
host issuing them one by one is slower than the GPU running them, so the GPU waits on the host
for most of the step (docs/performance.md, "On a GPU"). Captured once as a CUDA graph, the step
is one launch. A graph replays fixed shapes and fixed addresses, so a step's inputs are copied
into buffers the graph was captured over: token ids, positions, cache slots, context lengths and
block tables, for a batch padded up to the next captured size (1, 2, 4, then multiples of 8 up
to maxBatchSize, at most 512). Decode attention reads the lengths and tables on the device
(triton_attention), so one graph serves every context length. Padding rows decode token 0 at
position 0 into a scratch block that the KV pool never hands out, so they write nowhere that
matters; their logits are dropped.

Steps with a prompt chunk, or a batch larger than the largest graph, run eagerly as before.
`enforceEager: true` turns graphs off. Off CUDA (the tests) a "graph" is the same step run
eagerly on every replay, through the same buffers and padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from serve_app.engine.backends.metadata import AttentionMetadata, Decodes

log = logging.getLogger(__name__)

MAX_CAPTURED_BATCH = 512  # larger batches are rare, and each size is a graph of its own

# (input_ids [1, B], position_ids [1, B], metadata) -> logits [B, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, then every multiple of 8, up to max_batch."""
    top = min(max_batch, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else [*sizes, top]


class _Eager:
    """Stands in for a CUDA graph off CUDA: replay runs the step again."""

    def __init__(self, step: Callable[[], torch.Tensor]):
        self.step = step
        self.output = step()

    def replay(self) -> None:
        self.output = self.step()


class _Graph:
    """A captured CUDA graph and the output tensor its replays overwrite."""

    def __init__(self, step: Callable[[], torch.Tensor], pool, device: torch.device):
        side = torch.cuda.Stream(device)  # warm-up off the capture (lazy inits, autotuning)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = step()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """The captured decode steps of one model runner."""

    def __init__(
        self,
        forward: Forward,
        kv_caches,
        decode_kernel,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ):
        self.forward = forward
        self.kv_caches = kv_caches
        self.decode_kernel = decode_kernel
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.width = max_blocks  # block-table columns: a sequence of maxSeqLen tokens fits
        self.device = device
        self.sizes = batch_sizes(max_batch)
        self.inputs: dict[int, torch.Tensor] = {}  # per size: ids, positions, slots, lens, tables
        self.graphs: dict[int, _Graph | _Eager] = {}
        self.replays = 0

    # -- capture --------------------------------------------------------------------------------

    def _views(self, size: int):
        """The size's input buffer, split: one host-to-device copy fills them all."""
        buf = self.inputs[size]
        ids, positions, slots, lens = (buf[i * size : (i + 1) * size] for i in range(4))
        tables = buf[4 * size :].view(size, self.width)
        return ids, positions, slots, lens, tables

    def _step(self, size: int) -> Callable[[], torch.Tensor]:
        ids, positions, slots, lens, tables = self._views(size)
        md = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=slots,
            num_decodes=size,
            decode_kernel=self.decode_kernel,
            decodes=Decodes(tables, lens),
        )
        return lambda: self.forward(ids[None], positions[None], md)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        for size in reversed(self.sizes):
            host = self._host_inputs([], size)
            self.inputs[size] = host.to(self.device)
            step = self._step(size)
            self.graphs[size] = _Graph(step, pool, self.device) if on_cuda else _Eager(step)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        log.info(
            "decode graphs: %d batch sizes up to %d captured in %.1f s",
            len(self.sizes), self.sizes[-1], time.perf_counter() - start,
        )  # fmt: skip

    # -- replay ---------------------------------------------------------------------------------

    def covers(self, seqs: Sequence, num_new: Sequence[int]) -> bool:
        """Whether this step can replay a graph: decodes only, no more than the largest size,
        every block table within the captured width."""
        if not seqs or len(seqs) > self.sizes[-1] or any(n != 1 for n in num_new):
            return False
        return all(len(s.block_table) <= self.width for s in seqs)

    def _host_inputs(self, seqs: Sequence, size: int) -> torch.Tensor:
        block = self.block_size
        ids, positions, slots, lens, tables = [], [], [], [], []
        for seq in seqs:
            pos, table = seq.num_computed_tokens, seq.block_table
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // block] * block + pos % block)
            lens.append(pos + 1)
            tables.extend(table)
            tables.extend([0] * (self.width - len(table)))
        pad = size - len(seqs)  # token 0 at position 0 into the scratch block
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.scratch_block * block] * pad
        lens += [1] * pad
        tables += [self.scratch_block] * (pad * self.width)
        return torch.tensor(ids + positions + slots + lens + tables, dtype=torch.long)

    def run(self, seqs: Sequence) -> torch.Tensor:
        """Logits [len(seqs), vocab] of this decode step (seqs as covers() accepted them),
        valid until the next replay."""
        size = next(s for s in self.sizes if s >= len(seqs))
        self.inputs[size].copy_(self._host_inputs(seqs, size))
        graph = self.graphs[size]
        graph.replay()
        self.replays += 1
        return graph.output[: len(seqs)]
