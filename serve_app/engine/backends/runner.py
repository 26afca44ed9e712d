"""The model runner: the only engine piece that touches the device.

Loads the HF model, owns the paged KV cache tensors, packs a scheduled batch into one forward
pass (all new tokens concatenated, explicit positions) and returns logits only for the positions
that sample. What differs by device is its backend's (`backends.backend_for`): the attention
the layers call, what is done to the loaded model, how the cache is allocated and sized. Where
the backend wants them (CUDA), a step of decodes only replays a graph captured at start instead
(cuda/graphs.py), with a scratch KV block past the pool's for its padding rows.

With `world_size` above 1 the model is split over that many ranks (parallel/): this runner
is rank 0, the one the engine drives; before each call that touches the device it tells the
other ranks to run the same (`follow` is their side), and only it computes logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from serve_app.engine import kv_transfer
from serve_app.engine.backends import backend_for
from serve_app.engine.backends.cuda import graphs as cuda_graphs
from serve_app.engine.backends.device import check_local_ranks, pick_device, pick_dtype
from serve_app.engine.backends.metadata import build_metadata
from serve_app.engine.backends.parallel import kv as parallel_kv
from serve_app.engine.backends.parallel import plan
from serve_app.engine.backends.parallel.group import RankGroup
from serve_app.engine.backends.parallel.load import load_part
from serve_app.engine.backends.parallel.local import LocalRanks
from serve_app.engine.backends.parallel.rendezvous import Rendezvous
from serve_app.engine.config import EngineConfig
from serve_app.engine.errors import RankFailure
from serve_app.engine.kv_transfer import KVPayload
from serve_app.engine.sequence import Sequence
from serve_app.models.loader import load_config, load_model, load_tokenizer, resolve_model_path


@dataclass(slots=True)
class SeqView:
    """What a step's metadata reads of a sequence: sent to the other ranks instead of it."""

    num_computed_tokens: int
    block_table: list[int]


@dataclass(slots=True)
class Step:
    """One forward pass, as every rank runs it."""

    ids: list[int]
    positions: list[int]
    seqs: list  # Sequence or SeqView, decodes first
    num_new: list[int]
    keep: list[int]  # packed positions whose logits are returned


class ModelRunner:
    def __init__(self, config: EngineConfig, with_tokenizer: bool = True, rank: int = 0):
        self.config = config
        self.rank = rank
        self.device = pick_device(config.device, rank)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.backend = backend_for(config, self.device, self.dtype)
        self.model_path = resolve_model_path(config.model)
        # (an engine process leaves it to its parent, which loads it while this loads the model)
        self.tokenizer = load_tokenizer(self.model_path) if with_tokenizer else None
        world = config.world_size
        self.hf_config = load_config(self.model_path)
        # every rank's part (rank 0 gathers and hands out KV heads by them), this rank's
        self.splits = [plan.split_for(self.hf_config, r, world) for r in range(world)]
        self.split = self.splits[rank]
        if world == 1:
            self.model = load_model(self.model_path, self.dtype, self.device)
            self.ranks = self.local_ranks = None
        else:
            self.model, self.ranks, self.local_ranks = self._load_split()
        self.hf_config = self.model.config
        self.broken = False  # a step failed half-way across the ranks
        self.block_size = config.block_size
        self.model.set_attn_implementation(self.backend.attention(self.kv_shape))
        self.lm_head = self.backend.prepare(self.model, self._plain_lm_head())
        plan.reduce_outputs(self.model)  # rowwise layers no fused layer took over
        self.num_blocks = self._num_blocks()  # the pool's; a scratch block more with graphs
        graphs = self.backend.wants_decode_graphs() and self.ranks is None
        self.kv_caches = self._allocate_kv(self.num_blocks + int(graphs))
        self.backend.hold_kv(self.kv_caches)
        self.decode_graphs = self._capture_decode_graphs() if graphs else None

    # -- set-up ---------------------------------------------------------------------------------

    def _load_split(self):
        """world_size > 1: (model, RankGroup, LocalRanks or None). Rank 0 of an engine without a
        rendezvous starts the other ranks as local processes first (they load as it loads);
        each rank loads only its part of the weights, then the ranks join."""
        world = self.config.world_size
        found = plan.problems(self.hf_config, world)
        if found:
            raise ValueError(found[0])
        local = None
        if self.config.tp_rendezvous:
            rendezvous = Rendezvous.parse(self.config.tp_rendezvous)
        else:  # offline, or an engine process: the ranks are this machine's processes
            check_local_ranks(self.device, world)
            rendezvous = Rendezvous.here()
            local = LocalRanks(self.config.replace(tp_rendezvous=rendezvous.address))
        try:
            model = load_part(self.model_path, self.dtype, self.device, self.split)
            ranks = RankGroup(rendezvous, self.rank, world, self.device)
        except BaseException:
            if local is not None:
                local.close()
            raise
        plan.mark_reduce(model, ranks.all_reduce)
        return model, ranks, local

    def _plain_lm_head(self) -> torch.nn.Linear | None:
        """The LM head when logits are just hidden @ W^T (then the runner applies it only at
        the positions that sample), else None (the model's own forward computes them)."""
        head, cfg = self.model.get_output_embeddings(), self.hf_config
        extras = ("final_logit_softcapping", "logit_scale", "logits_scaling")
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            return None
        if any(getattr(cfg, name, None) not in (None, 1.0) for name in extras):
            return None
        return head

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(block size, this rank's KV heads, head size): one block of one layer's K or V."""
        return self.block_size, self.split.kv_heads, self.head_dim

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head size) of the model's whole KV, as the PD hand-off moves it."""
        cfg = self.hf_config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cfg.num_hidden_layers, heads, self.head_dim

    @property
    def bytes_per_block(self) -> int:
        block_size, heads, head_dim = self.kv_shape
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.hf_config.num_hidden_layers * block_size * heads * head_dim * element

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        if self.config.kv_cache_mem_gb > 0:
            budget = int(self.config.kv_cache_mem_gb * (1 << 30))
        else:
            budget = self.backend.kv_budget_bytes()
        blocks = max(1, budget // self.bytes_per_block)
        # each rank sizes the pool by its own device's free memory: all take the least, so that
        # every block id rank 0 hands out exists on every rank
        return blocks if self.ranks is None else self.ranks.least(blocks)

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, *self.kv_shape)
        zeros = self.backend.kv_zeros
        return [(zeros(shape), zeros(shape)) for _ in range(self.hf_config.num_hidden_layers)]

    def _capture_decode_graphs(self) -> cuda_graphs.DecodeGraphs:
        graphs = cuda_graphs.DecodeGraphs(
            self._forward, self.kv_caches, self.backend.decode_kernel, self.block_size,
            scratch_block=self.num_blocks,  # past the pool's blocks: never handed out
            max_batch=self.config.max_batch_size,
            max_blocks=-(-self.config.max_seq_len // self.block_size), device=self.device,
        )  # fmt: skip
        graphs.capture()
        return graphs

    # -- per step -------------------------------------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy on write: duplicate shared blocks before a fork writes into them."""
        if not pairs:
            return
        self._tell("copy", pairs)
        self._copy(pairs)

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def read_kv(self, block_table: list[int], num_tokens: int) -> KVPayload:
        """A sequence's first num_tokens positions of K/V, gathered to the host (PD export):
        every KV head of the model (rank 0 gathers the other ranks' heads)."""
        self._tell("read", block_table, num_tokens)
        payload = kv_transfer.gather(self.kv_caches, block_table, num_tokens, self.block_size)
        if self.ranks is None:
            return payload
        return parallel_kv.merge(self.ranks.gather(payload), self.splits)

    def write_kv(self, block_table: list[int], payload: KVPayload) -> None:
        """Scatter a payload (every KV head of the model) into blocks this runner's pool handed
        out (PD import); each rank takes its heads."""
        if self.ranks is not None:
            self._tell("write", block_table)
            parts = [parallel_kv.part(payload, split) for split in self.splits]
            payload = self.ranks.scatter(parts)
        kv_transfer.scatter(self.kv_caches, block_table, payload, self.block_size)

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new: list[int], sample: list[int]) -> torch.Tensor:
        """Run one step; return logits [len(sample), vocab] for seqs[i] in sample, in the
        model's dtype (the sampler widens them to float32 where it needs more than an argmax)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.covers(seqs, num_new):
            return graphs.run(seqs)[self._tensor(sample)]
        order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)  # decodes first
        seqs = [seqs[i] for i in order]
        num_new = [num_new[i] for i in order]
        ids: list[int] = []
        positions: list[int] = []
        last = {}
        for i, (seq, n) in zip(order, zip(seqs, num_new, strict=True), strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            last[i] = len(ids) - 1
        step = Step(ids, positions, seqs, num_new, [last[i] for i in sample])
        if self.ranks is None:
            return self._run(step)
        views = [SeqView(s.num_computed_tokens, s.block_table) for s in seqs]
        self.broken = True  # until the step is through: the ranks may be inside it
        self._tell("step", Step(ids, positions, views, num_new, step.keep))
        logits = self._run(step)
        self.broken = False
        return logits

    def _run(self, step: Step) -> torch.Tensor:
        backend = self.backend
        md = build_metadata(
            step.seqs, step.num_new, self.kv_caches, self.block_size, self.device,
            backend.decode_kernel, backend.prompt_rows,
        )  # fmt: skip
        ids, positions = self._tensor(step.ids)[None], self._tensor(step.positions)[None]
        return self._forward(ids, positions, md, self._tensor(step.keep))

    # -- the ranks ------------------------------------------------------------------------------

    def _tell(self, *message) -> None:
        if self.ranks is not None:
            self.ranks.tell(message)

    def follow(self) -> None:
        """A rank other than 0: run what rank 0 runs, until it says stop (or goes)."""
        while True:
            op, *args = self.ranks.hear()
            if op == "stop":
                return
            if op == "step":
                self._run(args[0])
            elif op == "copy":
                self._copy(args[0])
            elif op == "read":
                payload = kv_transfer.gather(self.kv_caches, *args, self.block_size)
                self.ranks.gather(payload)
            elif op == "write":
                payload = self.ranks.scatter(None)
                kv_transfer.scatter(self.kv_caches, args[0], payload, self.block_size)

    def close(self) -> None:
        """Rank 0: stop the other ranks; every rank: leave the group."""
        if self.ranks is None:
            return
        if self.local_ranks is not None:  # they exit as the pipe to them closes, mid-step too
            self.local_ranks.close()
        elif self.rank == 0 and not self.broken:  # (a step that failed may hold them in one)
            with contextlib.suppress(RankFailure):  # a rank already gone
                self._tell("stop")
        self.ranks.close()
        self.ranks = None

    def _forward(self, input_ids, position_ids, md, keep: torch.Tensor | None = None):
        """Logits at the packed positions `keep` (every position when None)."""
        inputs = dict(
            input_ids=input_ids, position_ids=position_ids, attn_metadata=md, use_cache=False
        )
        if self.rank != 0:  # only rank 0 computes logits; the others' hidden state is the same
            return self.model.get_decoder()(**inputs).last_hidden_state
        if self.lm_head is None:  # a head with extras (scaling, capping): the model's own
            kept = 0 if keep is None else keep  # transformers: 0 keeps every position
            return self.model(**inputs, logits_to_keep=kept).logits[0]
        hidden = self.model.get_decoder()(**inputs).last_hidden_state[0]
        return self.lm_head(hidden if keep is None else hidden[keep])
