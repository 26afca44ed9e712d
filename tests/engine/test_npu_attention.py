"""The NPU attention backend against the pure-torch one, with a strict fake torch_npu.

The fake implements, in plain torch, the documented semantics of the three ops the backend calls,
and refuses (KernelLimit) every call their documentation forbids: dtypes, shapes, layouts, the
length conventions (TND cumulative query lengths, per-sequence paged KV lengths, host-side
context lengths), the 2048x2048 causal mask of sparse_mode 3. docs/npu.md lists the rules, their
sources, and the two documented rules our calls break on purpose (DEVIATIONS) with the evidence.
It cannot prove the real kernels behave so; it proves that, if they do, the backend computes what
`torch_paged_attention` computes.
"""

from __future__ import annotations

import subprocess
import sys
import types
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from serve_app.engine.backends import attention
from serve_app.engine.backends.metadata import build_metadata
from serve_app.engine.backends.npu import attention as npu_attention


def _attend(q, keys, values, scale, visible):
    """q [Sq, H, D], keys/values [Skv, Hkv, D], visible [Sq, Skv] -> [Sq, H, D]."""
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).to(q.dtype)


def _paged(cache, table, length):
    """The first `length` tokens of a sequence stored in `cache` [blocks, bs, ...] via `table`."""
    block_size = cache.shape[1]
    blocks = table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


class KernelLimit(RuntimeError):
    """What the real kernel would refuse: a constraint its documentation states."""


# Documented constraints our calls break on purpose. docs/npu.md gives, for each, why we believe
# the kernel takes our call anyway and the evidence; the strict fake refuses these too unless it
# is told to tolerate them (it tolerates all of them by default, and records which it met).
DEVIATIONS = {
    # op-plugin FIA doc, TND constraints, query D != 512 without rope: Q_D = K_D = V_D = 128, or
    # Q_D = K_D = 192 with V_D 128 or 192. Our models have 64 (SmolLM2, demo) or 32 (demo-tiny).
    "tnd_head_dim",
    # TND constraints: actual_seq_lengths_kv holds cumulative sums, each >= the one before. Over
    # the paged cache we pass one length per sequence (the page-attention section's reading),
    # which need not grow from one sequence to the next.
    "paged_tnd_kv_lengths",
}
KERNEL_FLOATS = (torch.float16, torch.bfloat16)
# op-plugin FIA doc, input_layout: the layouts it lists
FIA_LAYOUTS = {
    "BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD",
    "TND", "TND_NTD", "NTD_TND",
}  # fmt: skip
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
# sparse_mode 2/3/4 take this "optimized" 2048 x 2048 mask, 1 (masked) above the diagonal
CAUSAL_2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _cumulative(lengths) -> bool:
    """TND: each element is its batch's length plus all before it: never negative, never less
    than the one before."""
    return all(0 <= a <= b for a, b in pairwise([0, *lengths]))


class FakeTorchNpu(types.ModuleType):
    """The torch_npu ops the backend calls, in plain torch, refusing (KernelLimit) every call
    their documentation forbids. Sources: op-plugin's docs for npu_fused_infer_attention_score
    (FIA); CANN's ATB reference (ascendtb) for PagedAttentionOperation and
    ReshapeAndCacheOperation, and op-plugin's ATB wrapper (op_plugin/ops/atb,
    utils/custom_functions/atb/AtbCommon.cpp) for what torch_npu adds to them."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []
        self.args: dict[str, dict] = {}  # each op's latest arguments, by the real API's names
        # The real kernels take float16 / bfloat16 only. Comparisons of the backend's indexing
        # against the torch backend may opt into float32 (exact arithmetic on the CPU); the
        # dtype rule itself is tested with it off.
        self.allow_float32 = False
        self.tolerated = set(DEVIATIONS)
        self.deviations: set[str] = set()  # the tolerated deviations the calls made

    def _floats(self) -> tuple[torch.dtype, ...]:
        return (*KERNEL_FLOATS, torch.float32) if self.allow_float32 else KERNEL_FLOATS

    @staticmethod
    def _need(ok, rule: str) -> None:
        if not ok:
            raise KernelLimit(rule)

    def _deviate(self, name: str, ok, rule: str) -> None:
        if not ok:
            self._need(name in self.tolerated, f"{rule} (deviation {name}, docs/npu.md)")
            self.deviations.add(name)

    def _npu_reshape_and_cache(self, *, key, value, key_cache, value_cache, slot_indices):
        self.calls.append(("reshape_and_cache", {}))
        self.args["reshape_and_cache"] = dict(
            key=key, value=value, key_cache=key_cache, value_cache=value_cache,
            slot_indices=slot_indices,
        )  # fmt: skip
        need = self._need
        # ascendtb ReshapeAndCacheOperation: key, value and both caches float16 / bfloat16 /
        # int8, all of one dtype
        need(key.dtype in (*self._floats(), torch.int8), f"reshape_and_cache: dtype {key.dtype}")
        need(
            value.dtype == key_cache.dtype == value_cache.dtype == key.dtype,
            "reshape_and_cache: key, value and caches of one dtype",
        )
        # key/value [num_tokens, num_head, head_size], caches [num_blocks, block_size,
        # num_head, head_size], slotMapping [num_tokens] int32
        need(
            key.dim() == value.dim() == 3 and key_cache.dim() == value_cache.dim() == 4,
            "reshape_and_cache: key/value 3-D, caches 4-D",
        )
        need(
            key.shape[1:] == key_cache.shape[2:] and value.shape[1:] == value_cache.shape[2:]
            and key_cache.shape[:2] == value_cache.shape[:2],
            "reshape_and_cache: key/value heads and head size are the caches'",
        )  # fmt: skip
        need(slot_indices.dtype == torch.int32, "reshape_and_cache: slotMapping int32")
        need(
            slot_indices.shape == key.shape[:1] == value.shape[:1],
            "reshape_and_cache: one slot per token",
        )
        # a slot is block_id * block_size + offset_in_block, inside the cache
        num_blocks, block_size = key_cache.shape[:2]
        slots = slot_indices.long()
        need(
            not len(slots) or 0 <= slots.min() and slots.max() < num_blocks * block_size,
            "reshape_and_cache: slot outside the cache",
        )
        # torch_npu's ATB wrapper copies inputs to contiguous ones but hands outputs as they are,
        # refusing a strided one (AtbCommon.cpp): the caches are written in place
        need(
            key_cache.is_contiguous() and value_cache.is_contiguous(),
            "reshape_and_cache: caches (outputs) contiguous",
        )
        key_cache[slots // block_size, slots % block_size] = key
        value_cache[slots // block_size, slots % block_size] = value

    def _npu_paged_attention(
        self,
        *,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        num_heads,
        scale_value,
        block_table,
        context_lens,
        out,
    ):
        self.calls.append(("paged_attention", {}))
        self.args["paged_attention"] = dict(
            query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
            num_heads=num_heads, scale_value=scale_value, block_table=block_table,
            context_lens=context_lens, out=out,
        )  # fmt: skip
        need = self._need
        # ascendtb PagedAttentionOperation, basic function: query [num_tokens, num_head,
        # head_size], caches [num_blocks, block_size, kv_head_num, head_size] and attnOut
        # float16 / bfloat16
        need(query.dtype in self._floats(), f"paged_attention: dtype {query.dtype}")
        need(
            key_cache.dtype == value_cache.dtype == out.dtype == query.dtype,
            "paged_attention: query, caches and out of one dtype",
        )
        need(
            query.dim() == 3 and key_cache.dim() == 4 and value_cache.shape == key_cache.shape,
            "paged_attention: query 3-D, caches 4-D of one shape",
        )
        num_blocks, block_size, kv_heads, head_size = key_cache.shape
        # constraints: block_size % 16 == 0, head_size in (0, 256], block_size * head_size <=
        # 128 * 128 (CANN 8.0: a hardware limit; later: in some modes; kept as the narrower)
        need(
            block_size % 16 == 0 and 0 < head_size <= 256 and block_size * head_size <= 128 * 128,
            f"paged_attention: block_size {block_size} x head_size {head_size} not supported",
        )
        # headNum > 0; the caches carry kvHeadNum heads; GQA: headNum % kvHeadNum == 0
        need(
            0 < num_heads == query.shape[1] and query.shape[2] == head_size,
            "paged_attention: query is [tokens, num_heads, head_size]",
        )
        need(
            0 < num_kv_heads == kv_heads and num_heads % num_kv_heads == 0,
            "paged_attention: num_kv_heads divides num_heads and matches the caches",
        )
        # blockTables [num_tokens, max_num_blocks_per_query] int32; contextLens [batch] int32,
        # a host (CPU) tensor; one query token per sequence in the basic function
        need(
            block_table.dtype == torch.int32 and block_table.dim() == 2,
            "paged_attention: blockTables 2-D int32",
        )
        need(
            context_lens.dtype == torch.int32 and context_lens.dim() == 1,
            "paged_attention: contextLens 1-D int32",
        )
        need(context_lens.device.type == "cpu", "paged_attention: contextLens on the host")
        need(
            query.shape[0] == block_table.shape[0] == context_lens.shape[0],
            "paged_attention: one query token, table row and length per sequence",
        )
        lengths = context_lens.tolist()
        # max_num_blocks_per_seq >= ceil(max(contextLens) / block_size); blockTables values
        # in [0, num_blocks)
        need(
            block_table.shape[1] * block_size >= max(lengths),
            "paged_attention: blockTables narrower than the longest context",
        )
        need(
            0 <= block_table.min() and block_table.max() < num_blocks,
            "paged_attention: blockTables value outside [0, num_blocks)",
        )
        # attnOut [num_tokens, num_head, head_size_v]; an output, so contiguous (AtbCommon.cpp)
        need(out.shape == query.shape, "paged_attention: out is [tokens, num_heads, head_size]")
        need(out.is_contiguous(), "paged_attention: out (an output) contiguous")
        for b, length in enumerate(lengths):
            keys = _paged(key_cache, block_table[b], length)
            values = _paged(value_cache, block_table[b], length)
            visible = torch.ones(1, length, dtype=torch.bool)
            out[b] = _attend(query[b : b + 1], keys, values, scale_value, visible)[0]

    def npu_fused_infer_attention_score(
        self,
        query,
        key,
        value,
        *,
        atten_mask=None,
        actual_seq_lengths=None,
        actual_seq_lengths_kv=None,
        block_table=None,
        num_heads=1,
        scale=1.0,
        input_layout="BSH",
        num_key_value_heads=0,
        sparse_mode=0,
        block_size=0,
    ):
        self.calls.append(("fused_infer_attention_score", {"paged": block_table is not None}))
        self.args["fused_infer_attention_score"] = dict(
            query=query, key=key, value=value, atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
            block_table=block_table, num_heads=num_heads, scale=scale, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
            block_size=block_size,
        )  # fmt: skip
        need = self._need
        # query float16 / bfloat16; key/value too (int8 / int4 only with the quantisation
        # arguments, which we do not pass), following the query's dtype
        need(query.dtype in self._floats(), f"FIA: query dtype {query.dtype}")
        need(key.dtype == value.dtype == query.dtype, "FIA: key/value dtype is the query's")
        # "non-contiguous tensors are not supported" (query, key, value, atten_mask)
        need(
            all(t.is_contiguous() for t in (query, key, value)),
            "FIA: query/key/value contiguous",
        )
        need(input_layout in FIA_LAYOUTS, f"FIA: input_layout {input_layout!r}")
        if input_layout != "TND":
            raise NotImplementedError(f"the fake implements TND only, not {input_layout}")
        # TND: query (T, Q_N, D); num_heads is Q_N; num_key_value_heads 0 means Q_N
        need(query.dim() == 3 and query.shape[1] == num_heads, "FIA: TND query is (T, Q_N, D)")
        kv_heads = num_key_value_heads or num_heads
        head_dim = query.shape[2]
        # Q_S > 1: N <= 256, D <= 512, D a multiple of 16 for float16 / bfloat16
        need(0 < kv_heads and num_heads <= 256, "FIA: N <= 256")
        need(head_dim <= 512 and head_dim % 16 == 0, f"FIA: head_dim {head_dim}")
        # num_heads a multiple of num_key_value_heads, at most 64 times it
        need(num_heads % kv_heads == 0, "FIA: num_heads a multiple of num_key_value_heads")
        need(num_heads // kv_heads <= 64, "FIA: num_heads <= 64 x num_key_value_heads")
        self._deviate("tnd_head_dim", head_dim in (128, 192), f"FIA: TND head_dim {head_dim}")
        need(type(scale) is float, "FIA: scale a float")
        # sparse_mode 0-4 only (5-8 "not supported"); 2/3/4 take the 2048 x 2048 mask, (S, S),
        # (1, S, S) or (1, 1, S, S), bool / int8 / uint8, lower-triangular (the caller's to
        # ensure), contiguous
        need(sparse_mode in range(5), f"FIA: sparse_mode {sparse_mode}")
        if sparse_mode in (2, 3, 4):
            need(atten_mask is not None, f"FIA: sparse_mode {sparse_mode} needs atten_mask")
            shape = tuple(atten_mask.shape)
            need(
                shape[-2:] == (2048, 2048) and len(shape) <= 4 and set(shape[:-2]) <= {1},
                f"FIA: atten_mask shape {shape}, not 2048 x 2048",
            )
            need(atten_mask.dtype in MASK_DTYPES, f"FIA: atten_mask dtype {atten_mask.dtype}")
            need(atten_mask.is_contiguous(), "FIA: atten_mask contiguous")
            need(
                torch.equal(atten_mask.reshape(2048, 2048).bool(), CAUSAL_2048),
                "FIA: atten_mask not the lower-triangular 2048 mask",
            )
        if sparse_mode != 3:
            raise NotImplementedError("the fake implements sparse_mode 3 (rightDownCausal) only")
        # TND: both length lists given (SymInt[]: host ints, not tensors), their count the
        # batch (<= 4096), each element the running sum up to its batch
        cu_q, kv_lens = actual_seq_lengths, actual_seq_lengths_kv
        for lengths in (cu_q, kv_lens):
            need(lengths is not None, "FIA: TND needs actual_seq_lengths and _kv")
            need(
                isinstance(lengths, list | tuple) and all(type(n) is int for n in lengths),
                "FIA: actual_seq_lengths(_kv) a list of host ints",
            )
            need(0 < len(lengths) <= 4096, "FIA: TND batch of 1 to 4096")
        batch = len(cu_q)
        need(len(kv_lens) == batch, "FIA: TND actual_seq_lengths and _kv of one batch")
        need(
            _cumulative(cu_q) and cu_q[-1] == query.shape[0],
            "FIA: TND actual_seq_lengths cumulative, up to T",
        )
        q_lens = [b - a for a, b in pairwise([0, *cu_q])]
        batches = []
        if block_table is None:  # packed TND K/V, (T, KV_N, D), cumulative lengths
            need(
                key.shape == value.shape and key.shape[1:] == (kv_heads, head_dim),
                "FIA: TND key/value are (T, KV_N, D)",
            )
            need(
                _cumulative(kv_lens) and kv_lens[-1] == key.shape[0],
                "FIA: TND actual_seq_lengths_kv cumulative, up to the keys' T",
            )
            batches = [(key[a:b], value[a:b]) for a, b in pairwise([0, *kv_lens])]
        else:
            # page attention: block_table 2-D int32 [B, >= maxBlockNumPerSeq]; block_size a
            # multiple of 128 in [128, 512] with more than one query token (TND: also a
            # multiple of 16, <= 1024); key/value of one shape, here (blocknum, block_size, H)
            # with H = KV_N * D <= 65535; actual_seq_lengths_kv per sequence
            need(
                block_table.dtype == torch.int32 and block_table.dim() == 2,
                "FIA: block_table 2-D int32",
            )
            need(block_table.shape[0] == batch, "FIA: block_table has a row per batch")
            need(
                block_size % 128 == 0 and 128 <= block_size <= 512,
                f"FIA: page attention block_size {block_size}",
            )
            need(key.shape == value.shape, "FIA: paged key and value of one shape")
            if key.dim() == 4:
                raise NotImplementedError("the fake implements the (blocknum, bs, H) cache")
            need(
                key.dim() == 3 and key.shape[1:] == (block_size, kv_heads * head_dim),
                "FIA: paged key/value are (blocknum, block_size, KV_N * D)",
            )
            need(kv_heads * head_dim <= 65535, "FIA: paged KV_N * D <= 65535")
            need(min(kv_lens) >= 0, "FIA: actual_seq_lengths_kv negative")
            self._deviate(
                "paged_tnd_kv_lengths",
                _cumulative(kv_lens),
                "FIA: TND actual_seq_lengths_kv not cumulative",
            )
            blocks = [-(-n // block_size) for n in kv_lens]
            need(
                block_table.shape[1] >= max(blocks),
                "FIA: block_table narrower than maxBlockNumPerSeq",
            )
            # blocknum >= the blocks all batches need; block ids valid (not checked by the
            # kernel: "the user's to ensure")
            need(key.shape[0] >= sum(blocks), "FIA: blocknum under the batches' blocks")
            used = [block_table[b, :n] for b, n in enumerate(blocks)]
            need(
                all(0 <= ids.min() and ids.max() < key.shape[0] for ids in used if len(ids)),
                "FIA: block id outside the cache",
            )
            for b, length in enumerate(kv_lens):
                k = _paged(key, block_table[b], length).view(length, kv_heads, head_dim)
                v = _paged(value, block_table[b], length).view(length, kv_heads, head_dim)
                batches.append((k, v))
        # the fake's own limit: rightDownCausal with more queries than keys leaves rows that
        # see nothing, which the backend never asks for
        assert all(q <= k.shape[0] for q, (k, _) in zip(q_lens, batches, strict=True))
        out = torch.empty_like(query)
        for b, (keys, values) in enumerate(batches):
            sq, skv = q_lens[b], keys.shape[0]
            i = torch.arange(sq)[:, None]
            j = torch.arange(skv)[None, :]
            rows = slice(cu_q[b] - sq, cu_q[b])
            out[rows] = _attend(query[rows], keys, values, scale, j <= skv - sq + i)  # rightDown
        return out, torch.zeros(1)  # softmax_lse_flag off: a [1] zero tensor

    def names(self):
        return [name for name, _ in self.calls]


@pytest.fixture
def strict_npu(monkeypatch):
    """The fake with the kernels' dtype rule on (float16 / bfloat16 only)."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.fixture
def fake_npu(strict_npu):
    """The fake also taking float32, for exact comparisons of the backend's indexing."""
    strict_npu.allow_float32 = True
    return strict_npu


BLOCK_SIZE = 128
NUM_BLOCKS = 40
CASES = {
    # name: (context lengths of decodes, (computed, new) of prompt chunks)
    "decodes": ([1, 5, 128, 129, 300], []),
    "fresh_prompts": ([], [(0, 2), (0, 130), (0, 17)]),
    # one length and no cached context: the torch backend's unpadded (dense) prefill path
    "fresh_prompts_of_one_length": ([], [(0, 19), (0, 19), (0, 19)]),
    "decodes_and_fresh_prompts_of_one_length": ([7, 130], [(0, 33), (0, 33)]),
    "decodes_and_fresh_prompts": ([7, 256, 2], [(0, 40), (0, 3)]),
    "chunked_prefill": ([33, 200], [(128, 20), (5, 140), (0, 9), (250, 2)]),
    "chunked_prefill_only": ([], [(1, 2), (127, 130)]),
}


def _metadata(seqs, num_new, kv_caches, device=torch.device("cpu")):
    """The metadata the model runner builds for this batch."""
    return build_metadata(seqs, num_new, kv_caches, BLOCK_SIZE, device)


def _batch(generator, decodes, prompts):
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    seqs, num_new = [], []
    for computed, new in [(c - 1, 1) for c in decodes] + prompts:
        table = [free.pop() for _ in range(-(-(computed + new) // BLOCK_SIZE))]
        seqs.append(SimpleNamespace(num_computed_tokens=computed, block_table=table))
        num_new.append(new)
    return seqs, num_new


def _compare(
    case, heads, kv_heads, scaling, device="cpu", dtype=torch.float32, tol=1e-5, head_dim=None
):
    """Run both backends on one random packed batch (2 layers); the torch one in float32 on the
    CPU, the NPU one on `device` in `dtype`. Compare outputs and the caches written."""
    seed = sorted(CASES).index(case) * 100 + heads * 10 + kv_heads
    generator = torch.Generator().manual_seed(seed)
    head_dim = head_dim or (16 if device == "cpu" else 128)
    layers = 2
    seqs, num_new = _batch(generator, *CASES[case])
    total = sum(num_new)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).float()

    # Random caches stand in for the K/V that earlier steps wrote for the cached context.
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    ref_caches = [(rand(*shape), rand(*shape)) for _ in range(layers)]
    npu_caches = [(k.to(device, dtype), v.to(device, dtype)) for k, v in ref_caches]
    ref_md = _metadata(seqs, num_new, ref_caches)
    npu_md = _metadata(seqs, num_new, npu_caches, torch.device(device))
    for layer in range(layers):  # the second layer reuses the per-step conversion
        module = SimpleNamespace(layer_idx=layer)
        q = rand(1, heads, total, head_dim)
        k, v = rand(1, kv_heads, total, head_dim), rand(1, kv_heads, total, head_dim)
        want, _ = attention.torch_paged_attention(
            module, q, k, v, None, scaling=scaling, attn_metadata=ref_md
        )
        got, weights = npu_attention.npu_paged_attention(
            module,
            *(t.to(device, dtype) for t in (q, k, v)),
            None,
            scaling=scaling,
            attn_metadata=npu_md,
        )
        assert weights is None and got.shape == (1, total, heads, head_dim)
        torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol)
        for written, expected in zip(npu_caches[layer], ref_caches[layer], strict=True):
            assert torch.equal(written.cpu().float(), expected)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_matches_torch_backend(fake_npu, case, heads, kv_heads, scaling):
    _compare(case, heads, kv_heads, scaling)
    decodes, prompts = CASES[case]
    layers = 2
    assert fake_npu.names().count("reshape_and_cache") == layers
    assert fake_npu.names().count("paged_attention") == (layers if decodes else 0)
    fia = [info for name, info in fake_npu.calls if name == "fused_infer_attention_score"]
    paged = any(computed for computed, _ in prompts)
    assert fia == ([{"paged": paged}] * layers if prompts else [])


def test_only_fresh_prompts_of_one_length_skip_the_padding():
    caches = [
        (torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, 16), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, 16))
    ]
    dense = set()
    for case in CASES:
        md = _metadata(*_batch(torch.Generator().manual_seed(0), *CASES[case]), caches)
        if md.prompts is not None and md.prompts.dense:
            dense.add(case)
    assert dense == {"fresh_prompts_of_one_length", "decodes_and_fresh_prompts_of_one_length"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_backend_with_smollm2_shapes(fake_npu, case):
    # SmolLM2-135M: 9 query heads over 3 KV heads (3:1), head_dim 64, within the ops' limits
    _compare(case, 9, 3, None, head_dim=64)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_backend_in_the_kernels_dtypes(strict_npu, case, dtype):
    _compare(case, 8, 2, None, dtype=dtype, tol=2e-2)


def test_the_fake_refuses_what_the_kernels_refuse(strict_npu):
    with pytest.raises(KernelLimit, match="dtype"):  # float32 is not a kernel dtype
        _compare("decodes", 8, 2, None, dtype=torch.float32)
    with pytest.raises(KernelLimit, match="block_size 128 x head_size 256"):
        _compare("decodes", 8, 2, None, dtype=torch.bfloat16, head_dim=256)


# The shapes of the models we serve: (query heads, KV heads, head_dim)
SERVED_SHAPES = {
    "demo-tiny": (4, 2, 32),
    "demo": (8, 2, 64),  # Qwen2-style
    "smollm2-135m": (9, 3, 64),
    "demo-1b": (32, 8, 64),  # Llama-3.2-1B's shapes
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model", sorted(SERVED_SHAPES))
def test_the_backend_calls_for_the_served_shapes_pass_the_strict_fake(strict_npu, case, model):
    heads, kv_heads, head_dim = SERVED_SHAPES[model]
    _compare(case, heads, kv_heads, None, dtype=torch.bfloat16, tol=2e-2, head_dim=head_dim)
    assert strict_npu.deviations <= DEVIATIONS  # nothing else the documentation forbids


def _recorded_calls() -> dict[str, dict]:
    """The backend's own calls for SmolLM2's shapes in bfloat16, as the strict fake saw them:
    each op's arguments, FIA once over the paged cache and once over fresh K/V."""
    recorded = {}
    for case, paged in (("chunked_prefill", "paged"), ("decodes_and_fresh_prompts", "fresh")):
        fake = FakeTorchNpu()
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "torch_npu", fake)
            _compare(case, 9, 3, None, dtype=torch.bfloat16, tol=2e-2, head_dim=64)
        recorded["reshape_and_cache"] = fake.args["reshape_and_cache"]
        recorded["paged_attention"] = fake.args.get("paged_attention")
        recorded[f"fia_{paged}"] = fake.args["fused_infer_attention_score"]
    assert recorded["fia_paged"]["block_table"] is not None
    assert recorded["fia_fresh"]["block_table"] is None
    return recorded


def _call(fake, op: str, args: dict):
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if op.startswith("fia"):
        q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
        return fake.npu_fused_infer_attention_score(q, k, v, **args)
    return getattr(fake, f"_npu_{op}")(**args)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values and shape, not contiguous."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _heads(a: dict, heads: int, head_dim: int | None = None, kv: int = 3) -> dict:
    """FIA over fresh K/V with other head counts / head_dim (zeros: only shapes matter)."""
    t, d = a["query"].shape[0], head_dim or a["query"].shape[2]
    bf16 = dict(dtype=torch.bfloat16)
    key = torch.zeros(t, kv, d, **bf16)
    return dict(
        query=torch.zeros(t, heads, d, **bf16),
        key=key,
        value=key.clone(),
        num_heads=heads,
        num_key_value_heads=kv,
    )


def _paged_heads(a: dict, heads: int, head_size: int, block_size: int, num_blocks: int = 4):
    """ATB paged attention with other head counts / head size / block size (zeros)."""
    bf16 = dict(dtype=torch.bfloat16)
    cache = torch.zeros(num_blocks, block_size, 3, head_size, **bf16)
    query = torch.zeros(2, heads, head_size, **bf16)
    return dict(
        query=query,
        key_cache=cache,
        value_cache=cache.clone(),
        num_heads=heads,
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        context_lens=torch.tensor([1, 2], dtype=torch.int32),
        out=torch.empty_like(query),
    )


BF16, F32 = torch.bfloat16, torch.float32
# (op, what breaks, the arguments it changes (from the recorded call's), the refusal's words).
# One entry per documented constraint the fake enforces; see FakeTorchNpu for the sources.
VIOLATIONS = [
    # ReshapeAndCache
    ("reshape_and_cache", "float32", lambda a: {
        k: a[k].float() for k in ("key", "value", "key_cache", "value_cache")
    }, "reshape_and_cache: dtype"),
    ("reshape_and_cache", "mixed dtypes", lambda a: {"key": a["key"].half()}, "of one dtype"),
    ("reshape_and_cache", "3-D caches", lambda a: {
        k: a[k].flatten(2) for k in ("key_cache", "value_cache")
    }, "caches 4-D"),
    ("reshape_and_cache", "other head count", lambda a: {
        k: a[k][:, :2].contiguous() for k in ("key", "value")
    }, "heads and head size"),
    ("reshape_and_cache", "int64 slots", lambda a: {"slot_indices": a["slot_indices"].long()},
     "slotMapping int32"),
    ("reshape_and_cache", "a slot short", lambda a: {"slot_indices": a["slot_indices"][:-1]},
     "one slot per token"),
    ("reshape_and_cache", "slot past the cache", lambda a: {
        "slot_indices": a["slot_indices"].clone().fill_(NUM_BLOCKS * BLOCK_SIZE)
    }, "slot outside the cache"),
    ("reshape_and_cache", "strided cache", lambda a: {"key_cache": _strided(a["key_cache"])},
     "caches \\(outputs\\) contiguous"),
    # ATB PagedAttention
    ("paged_attention", "float32", lambda a: {
        k: a[k].float() for k in ("query", "key_cache", "value_cache", "out")
    }, "paged_attention: dtype"),
    ("paged_attention", "mixed dtypes", lambda a: {"out": a["out"].half()}, "of one dtype"),
    ("paged_attention", "3-D caches", lambda a: {
        k: a[k].flatten(2) for k in ("key_cache", "value_cache")
    }, "caches 4-D"),
    ("paged_attention", "block_size 8", lambda a: {
        k: a[k].view(NUM_BLOCKS * 16, 8, 3, 64) for k in ("key_cache", "value_cache")
    }, "block_size 8 x head_size 64 not supported"),
    ("paged_attention", "head_size 320", lambda a: _paged_heads(a, 9, 320, 16),
     "block_size 16 x head_size 320 not supported"),
    ("paged_attention", "block x head over 128 x 128", lambda a: _paged_heads(a, 9, 128, 256),
     "block_size 256 x head_size 128 not supported"),
    ("paged_attention", "num_heads not the query's", lambda a: {"num_heads": 3},
     "query is \\[tokens, num_heads, head_size\\]"),
    ("paged_attention", "num_kv_heads not dividing", lambda a: _paged_heads(a, 8, 64, 128),
     "num_kv_heads divides num_heads"),
    ("paged_attention", "num_kv_heads not the caches'", lambda a: {"num_kv_heads": 1},
     "matches the caches"),
    ("paged_attention", "int64 block table", lambda a: {"block_table": a["block_table"].long()},
     "blockTables 2-D int32"),
    ("paged_attention", "int64 lengths", lambda a: {"context_lens": a["context_lens"].long()},
     "contextLens 1-D int32"),
    ("paged_attention", "lengths on the device", lambda a: {
        "context_lens": a["context_lens"].to("meta")
    }, "contextLens on the host"),
    ("paged_attention", "a length short", lambda a: {"context_lens": a["context_lens"][:1]},
     "one query token, table row and length per sequence"),
    ("paged_attention", "table too narrow", lambda a: {
        "block_table": a["block_table"][:, :1].contiguous()
    }, "narrower than the longest context"),
    ("paged_attention", "block id past the cache", lambda a: {
        "block_table": a["block_table"].clone().fill_(NUM_BLOCKS)
    }, "outside \\[0, num_blocks\\)"),
    ("paged_attention", "out of another shape", lambda a: {"out": a["out"][..., :32].clone()},
     "out is \\[tokens"),
    ("paged_attention", "strided out", lambda a: {"out": _strided(a["out"])},
     "out \\(an output\\) contiguous"),
    # FusedInferAttentionScore, TND
    ("fia_paged", "float32", lambda a: {k: a[k].float() for k in ("query", "key", "value")},
     "FIA: query dtype"),
    ("fia_paged", "mixed dtypes", lambda a: {k: a[k].half() for k in ("key", "value")},
     "key/value dtype"),
    ("fia_paged", "strided query", lambda a: {"query": _strided(a["query"])},
     "query/key/value contiguous"),
    ("fia_paged", "unknown layout", lambda a: {"input_layout": "THD"}, "input_layout 'THD'"),
    ("fia_paged", "num_heads not the query's", lambda a: {"num_heads": 3},
     "TND query is \\(T, Q_N, D\\)"),
    ("fia_fresh", "258 heads", lambda a: _heads(a, 258, kv=3), "N <= 256"),
    ("fia_fresh", "heads not a multiple", lambda a: _heads(a, 8), "a multiple of num_key_value"),
    ("fia_fresh", "65 query heads a KV head", lambda a: _heads(a, 65, kv=1),
     "num_heads <= 64 x num_key_value_heads"),
    ("fia_fresh", "head_dim 72", lambda a: _heads(a, 9, 72), "head_dim 72"),
    ("fia_fresh", "head_dim 528", lambda a: _heads(a, 9, 528), "head_dim 528"),
    ("fia_paged", "tensor scale", lambda a: {"scale": torch.tensor(a["scale"])}, "scale a float"),
    ("fia_paged", "sparse_mode 5", lambda a: {"sparse_mode": 5}, "sparse_mode 5"),
    ("fia_paged", "no mask", lambda a: {"atten_mask": None}, "needs atten_mask"),
    ("fia_paged", "(Q_S, KV_S) mask", lambda a: {
        "atten_mask": torch.ones(171, 252, dtype=torch.int8).triu(1)
    }, "atten_mask shape"),
    ("fia_paged", "float16 mask", lambda a: {"atten_mask": a["atten_mask"].half()},
     "atten_mask dtype"),
    ("fia_paged", "strided mask", lambda a: {"atten_mask": _strided(a["atten_mask"])},
     "atten_mask contiguous"),
    ("fia_paged", "upper-triangular mask", lambda a: {
        "atten_mask": a["atten_mask"].t().contiguous()
    }, "not the lower-triangular 2048 mask"),
    ("fia_paged", "no query lengths", lambda a: {"actual_seq_lengths": None},
     "TND needs actual_seq_lengths"),
    ("fia_paged", "no KV lengths", lambda a: {"actual_seq_lengths_kv": None},
     "TND needs actual_seq_lengths"),
    ("fia_paged", "lengths as a tensor", lambda a: {
        "actual_seq_lengths": torch.tensor(a["actual_seq_lengths"])
    }, "a list of host ints"),
    ("fia_paged", "4097 sequences", lambda a: {"actual_seq_lengths": [1] * 4097},
     "TND batch of 1 to 4096"),
    ("fia_paged", "a KV length short", lambda a: {
        "actual_seq_lengths_kv": a["actual_seq_lengths_kv"][:-1]
    }, "of one batch"),
    ("fia_paged", "per-sequence query lengths", lambda a: {
        "actual_seq_lengths": [y - x for x, y in pairwise([0, *a["actual_seq_lengths"]])]
    }, "actual_seq_lengths cumulative"),
    ("fia_paged", "query lengths short of T", lambda a: {
        "actual_seq_lengths": [*a["actual_seq_lengths"][:-1], a["actual_seq_lengths"][-1] - 1]
    }, "actual_seq_lengths cumulative, up to T"),
    ("fia_fresh", "KV heads not num_key_value_heads", lambda a: {"num_key_value_heads": 9},
     "key/value are \\(T, KV_N, D\\)"),
    ("fia_fresh", "per-sequence KV lengths", lambda a: {
        "actual_seq_lengths_kv": [y - x for x, y in pairwise([0, *a["actual_seq_lengths_kv"]])]
    }, "actual_seq_lengths_kv cumulative"),
    ("fia_paged", "int64 block table", lambda a: {"block_table": a["block_table"].long()},
     "block_table 2-D int32"),
    ("fia_paged", "a table row short", lambda a: {"block_table": a["block_table"][:-1]},
     "a row per batch"),
    ("fia_paged", "block_size 64", lambda a: {"block_size": 64}, "block_size 64"),
    ("fia_paged", "block_size 640", lambda a: {"block_size": 640}, "block_size 640"),
    ("fia_paged", "key and value shapes differ", lambda a: {"value": a["value"][:-1]},
     "of one shape"),
    ("fia_paged", "cache not (blocknum, block_size, H)", lambda a: {
        k: a[k].view(NUM_BLOCKS * 2, 64, 192) for k in ("key", "value")
    }, "\\(blocknum, block_size, KV_N \\* D\\)"),
    ("fia_paged", "KV_N * D over 65535", lambda a: {
        "query": torch.empty(1, 256, 512, dtype=BF16),
        "key": torch.empty(1, 128, 256 * 512, dtype=BF16),
        "value": torch.empty(1, 128, 256 * 512, dtype=BF16),
        "num_heads": 256, "num_key_value_heads": 256, "actual_seq_lengths": [1],
        "actual_seq_lengths_kv": [1], "block_table": torch.zeros(1, 1, dtype=torch.int32),
    }, "KV_N \\* D <= 65535"),
    ("fia_paged", "negative KV length", lambda a: {
        "actual_seq_lengths_kv": [-1, *a["actual_seq_lengths_kv"][1:]]
    }, "actual_seq_lengths_kv negative"),
    ("fia_paged", "table too narrow", lambda a: {
        "block_table": a["block_table"][:, :1].contiguous()
    }, "narrower than maxBlockNumPerSeq"),
    ("fia_paged", "fewer blocks than the batch needs", lambda a: {
        k: a[k][:3] for k in ("key", "value")
    }, "blocknum under"),
    ("fia_paged", "block id past the cache", lambda a: {
        "block_table": a["block_table"].clone().fill_(NUM_BLOCKS)
    }, "block id outside the cache"),
]  # fmt: skip


@pytest.fixture(scope="module")
def recorded_calls():
    return _recorded_calls()


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention", "fia_paged", "fia_fresh"])
def test_the_recorded_calls_pass_the_strict_fake(recorded_calls, op):
    # what the violations below change, unchanged
    fake = FakeTorchNpu()
    _call(fake, op, recorded_calls[op])
    assert fake.deviations <= DEVIATIONS


@pytest.mark.parametrize(
    ("op", "change", "refusal"),
    [(op, change, refusal) for op, _, change, refusal in VIOLATIONS],
    ids=[f"{op}-{what}" for op, what, _, _ in VIOLATIONS],
)
def test_the_strict_fake_refuses_each_documented_violation(recorded_calls, op, change, refusal):
    args = recorded_calls[op]
    with pytest.raises(KernelLimit, match=refusal):
        _call(FakeTorchNpu(), op, {**args, **change(args)})


@pytest.mark.parametrize("shape", [(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8])
def test_the_strict_fake_takes_every_documented_mask_form(recorded_calls, shape, dtype):
    args = recorded_calls["fia_paged"]
    mask = args["atten_mask"].to(dtype).reshape(shape)
    _call(FakeTorchNpu(), "fia_paged", {**args, "atten_mask": mask})


@pytest.mark.parametrize("deviation", sorted(DEVIATIONS))
def test_the_strict_fake_refuses_our_deviations_unless_tolerated(strict_npu, deviation):
    # the calls the backend makes for SmolLM2 break each rule, and the fake knows it
    strict_npu.tolerated.discard(deviation)
    with pytest.raises(KernelLimit, match=f"deviation {deviation}"):
        _compare("chunked_prefill", 9, 3, None, dtype=torch.bfloat16, tol=2e-2, head_dim=64)


def test_every_deviation_is_stated_with_its_evidence_in_docs():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "npu.md").read_text()
    assert all(f"`{name}`" in text for name in DEVIATIONS)


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_size", "message"),
    [
        (torch.float32, 128, 64, "ModelConfig.dtype float32 cannot run on NPU"),
        (torch.bfloat16, 16, 64, "ScheduleConfig.cacheBlockSize 16 cannot page on NPU"),
        (torch.bfloat16, 640, 64, "ScheduleConfig.cacheBlockSize 640 cannot page on NPU"),
        (torch.float16, 256, 128, "cacheBlockSize 256 x head size 128 = 32768 is over"),
        (torch.bfloat16, 128, 512, "head size 512 is outside"),
    ],
)
def test_npu_configs_the_kernels_cannot_run_are_refused_at_load(
    dtype, block_size, head_size, message
):
    with pytest.raises(ValueError, match=message):
        npu_attention.check_limits(dtype, block_size, head_size)
    npu_attention.check_limits(torch.bfloat16, 128, 128)  # the recommended shape passes
    npu_attention.check_limits(torch.float16, 256, 64)


def test_the_model_runner_checks_the_limits_when_it_picks_the_npu_backend(monkeypatch):
    from serve_app.engine.backends import backend_for

    seen = []
    monkeypatch.setattr(npu_attention, "check_limits", lambda *args: seen.append(args))
    monkeypatch.setattr(npu_attention, "register", lambda: "npu-backend")
    config = SimpleNamespace(block_size=128)
    backend = backend_for(config, SimpleNamespace(type="npu"), torch.float32)
    assert backend.attention((128, 2, 64)) == "npu-backend"
    assert seen == [(torch.float32, 128, 64)]


@pytest.mark.npu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (9, 3, 64)])
def test_matches_torch_backend_on_real_npu(case, dtype, heads, kv_heads, head_dim):
    # The same comparison against the real kernels; runs only where torch_npu sees an NPU.
    # head_dim 64 (SmolLM2, demo) is the TND deviation docs/npu.md argues for: this is where
    # hardware confirms or refutes it.
    from serve_app.engine.backends.device import npu_available

    if not npu_available():
        pytest.skip("needs torch_npu and an Ascend NPU")
    _compare(case, heads, kv_heads, None, device="npu", dtype=dtype, tol=2e-2, head_dim=head_dim)


def test_rejects_block_size_fia_cannot_page(fake_npu):
    caches = [(torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16))]
    seqs = [SimpleNamespace(num_computed_tokens=16, block_table=[0, 1])]
    md = build_metadata(seqs, [4], caches, 16, torch.device("cpu"))
    x = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="multiple of 128"):
        npu_attention.npu_paged_attention(
            SimpleNamespace(layer_idx=0), x, x, x, None, attn_metadata=md
        )


def test_register_adds_attention_and_no_mask():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = npu_attention.register()
    assert name == npu_attention.ATTENTION_NAME != attention.ATTENTION_NAME
    assert AttentionInterface()[name] is npu_attention.npu_paged_attention
    assert name not in AttentionMaskInterface()  # transformers builds none (test_attention)


def test_imports_without_torch_npu():
    code = (
        "import sys; sys.modules['torch_npu'] = None\n"  # any `import torch_npu` now fails
        "import serve_app.engine.backends.npu.attention as m\n"
        "assert callable(m.npu_paged_attention) and callable(m.register)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def tiny_greedy(prompts, hf_greedy_of):
    """transformers' greedy tokens for the prompts on demo-tiny (16, EOS ignored). A module
    fixture: set up before any fake torch_npu, which transformers' imports would probe."""
    from transformers import AutoModelForCausalLM

    from serve_app.models.demo import ensure_demo_model

    model = AutoModelForCausalLM.from_pretrained(ensure_demo_model("demo-tiny"))
    return hf_greedy_of(model.eval(), prompts, 16)[0]


def test_engine_greedy_matches_transformers_on_fake_npu(fake_npu, prompts, tiny_greedy):
    # The whole engine on a demo model, attention swapped for the NPU backend: chunked
    # prefill (48-token budget) mixes decodes, fresh prompts and prompts with cached context.
    # demo-tiny: its last layer, like the demo's, picks the next token from the K/V cached one
    # position back, so a misplaced cache read changes the tokens.
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(
        "demo-tiny",
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_seq_len=1024,
        max_prefill_tokens=48,
        max_input_token_len=48,
    )
    llm.engine.runner.model.set_attn_implementation(npu_attention.register())
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == tiny_greedy
    assert {"paged_attention", "fused_infer_attention_score"} <= set(fake_npu.names())
    assert {"paged": True} in [info for _, info in fake_npu.calls]


def test_engine_on_smollm2_matches_transformers_on_fake_npu(
    fake_npu, smollm2_path, hf_smollm2, hf_greedy_of
):
    # The real Llama model through the NPU backend's shape checks and kernels' semantics.
    from transformers import AutoTokenizer

    from serve_app.engine import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of Germany is", "Once upon a time, in a small village by the sea,"]
    prompts = [tok(t).input_ids for t in texts]
    want, _ = hf_greedy_of(hf_smollm2, prompts, 8, ignore_eos=False)
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        max_seq_len=512,
        max_prefill_tokens=8,
        max_input_token_len=8,
    )
    llm.engine.runner.model.set_attn_implementation(npu_attention.register())
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert {"paged_attention", "fused_infer_attention_score"} <= set(fake_npu.names())


def test_engine_in_bfloat16_on_the_strict_fake_matches_the_cpu_engine(monkeypatch, smollm2_path):
    # SmolLM2 in bfloat16 through the NPU backend, every kernel call checked against the
    # documented constraints (float32 refused), against the CPU engine's own bfloat16 path on
    # the same weights. Only attention differs, and both round its output to bfloat16 from a
    # wider sum (the fake in float64, the CPU kernel in float32): measured, all 4 x 16 tokens
    # agree (6 x 24 too), so one flipped argmax is a bug, not rounding.
    from transformers import AutoTokenizer

    from serve_app.engine import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = [
        "The capital of Germany is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "Water boils at a temperature of",
    ]
    prompts = [tok(t).input_ids for t in texts]
    # A 16-token budget splits the longer prompts, so steps mix decodes, fresh prompts and
    # chunks over cached context; no prefix caching, so the second run computes all its K/V.
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        max_seq_len=512,
        max_prefill_tokens=16,
        max_input_token_len=16,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # the fake goes in after transformers' imports, which probe for a real torch_npu
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    llm.engine.runner.model.set_attn_implementation(npu_attention.register())
    npu = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert not fake.allow_float32
    assert npu == cpu
    assert {"paged": True} in [info for _, info in fake.calls]
    assert {"reshape_and_cache", "paged_attention"} <= set(fake.names())
