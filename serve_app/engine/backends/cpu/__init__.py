"""What the engine adds on CPU: its own C++ kernels (`kernels`, sources in csrc/) for paged
decode attention, the argmax (`argmax`) and GEMMs that stream packed weights (`gemm`), decoder
layers fused around them (`layers`), and helpers on spare cores (`spare_cores`)."""

from __future__ import annotations

import torch

from serve_app.engine.backends.base import Backend
from serve_app.engine.backends.cpu import commit, gemm, kernels, layers
from serve_app.engine.backends.cpu.argmax import row_argmax
from serve_app.engine.backends.cpu.spare_cores import shared_chunks
from serve_app.engine.backends.device import free_memory_bytes


class CPUBackend(Backend):
    """Where the kernels are built and the dtype is one they take (float32, bfloat16): every
    token attends through the paged kernel as a row of its own (a decode over its context, each
    prompt token over its sequence's cache up to itself), Llama- and Qwen2-shaped decoder layers
    are fused, every Linear and the LM head run on packed weights. Elsewhere: torch's."""

    prompt_rows = True

    def __init__(self, config, device, dtype):
        super().__init__(config, device, dtype)
        self.packs = gemm.supported(device, dtype)
        if self.packs:
            self.decode_kernel = kernels.paged_decode_attention()
        self.fused_layers = 0  # decoder layers computed by layers.FusedDecoderLayer
        self.packed_linears = 0  # the decoder's other Linears and the head (gemm.linear)

    def prepare(self, model, lm_head):
        if not self.packs:
            return lm_head
        decoder = model.get_decoder()
        hidden_act = getattr(model.config, "hidden_act", None)
        self.fused_layers = layers.fuse_decoder_layers(decoder, hidden_act)
        self.packed_linears = gemm.pack_linears(decoder)
        if lm_head is not None:
            lm_head = gemm.linear(lm_head.weight)
            self.packed_linears += 1
        return lm_head

    def kv_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        huge = kernels.op("zeros_on_huge_pages")
        if huge is None:
            return super().kv_zeros(shape)
        # on 2 MiB pages where the OS gives them (decode attention reads each sequence's blocks
        # all over the cache: fewer TLB misses): the kernel's zeros, allocated as they are
        # written or by hold_kv's thread; written in now where the kernel cannot do that
        cache = huge(list(shape), self.dtype)
        return cache if commit.can_commit(cache) else cache.zero_()

    def hold_kv(self, caches):
        if kernels.op("zeros_on_huge_pages") is not None:  # (else torch.zeros': held already)
            commit.commit_later([t for pair in caches for t in pair if commit.can_commit(t)])

    def kv_budget_bytes(self) -> int:
        return free_memory_bytes(self.device)

    def stats(self) -> dict[str, int]:
        """With engineSpareCpus: where the kernels' chunks ran (spare_cores.shared_chunks)."""
        return shared_chunks()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return row_argmax(x)
