"""Paged attention on Ascend NPUs through torch_npu's fused kernels.

Same contract and metadata as `attention.torch_paged_attention`; only the kernels differ:
- new K/V go into the paged cache with ATB ReshapeAndCache (`torch_npu._npu_reshape_and_cache`),
- decodes run ATB PagedAttention (`torch_npu._npu_paged_attention`) over their block tables,
- prompt chunks run FusedInferAttentionScore (`torch_npu.npu_fused_infer_attention_score`, FIA)
  in the packed "TND" layout: over the paged cache when some prompt has cached context,
  otherwise over the fresh K/V directly.

Argument conventions follow the torch_npu API reference (Ascend/op-plugin,
docs/context/torch_npu-npu_fused_infer_attention_score.md), the ATB operation reference
(hiascend.com CANN "ascendtb" PagedAttention page) and vllm-ascend's backend, which runs these
exact calls on our cache layout (vllm_ascend/attention/attention_v1.py; `_npu_reshape_and_cache`
in vllm_ascend/device/device_op.py). Assumes CANN >= 8.3: vllm-ascend moved chunked prefill to
these FIA TND calls with CANN 8.3 (older CANN: ATB `_npu_paged_attention_splitfuse`).
torch_npu is imported inside the functions so this module imports on machines without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from serve_app.engine.backends import attention
from serve_app.engine.backends.metadata import AttentionMetadata

ATTENTION_NAME = "serve_app_npu_paged"
MASK_SIZE = 2048  # FIA sparse_mode 2/3/4 take a fixed-size 2048x2048 "compressed" causal mask
# FIA page attention with more than one query token per sequence: "block_size at least 128, at
# most 512, a multiple of 128" (op-plugin doc above); 128 is also what vllm-ascend uses.
FIA_BLOCK_ALIGN = 128
FIA_BLOCK_MAX = 512
# ATB PagedAttention / ReshapeAndCache (ascendtb reference, "constraints"): float16 or bfloat16
# tensors, head_size in (0, 256], block_size * head_size <= 128 * 128.
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 256
MAX_BLOCK_X_HEAD = 128 * 128


def check_limits(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    """Refuses, at load, a configuration these kernels cannot run, naming the config key."""
    problems = []
    if dtype not in KERNEL_DTYPES:
        problems.append(
            f"ModelConfig.dtype {str(dtype).removeprefix('torch.')} cannot run on NPU: the "
            "torch_npu paged-attention, reshape-and-cache and fused-attention kernels take "
            "float16 or bfloat16 (use bfloat16, float16 or auto)"
        )
    if block_size % FIA_BLOCK_ALIGN or not FIA_BLOCK_ALIGN <= block_size <= FIA_BLOCK_MAX:
        problems.append(
            f"ScheduleConfig.cacheBlockSize {block_size} cannot page on NPU: fused attention "
            f"over the paged cache needs a multiple of {FIA_BLOCK_ALIGN} in "
            f"[{FIA_BLOCK_ALIGN}, {FIA_BLOCK_MAX}] (128 recommended)"
        )
    if not 0 < head_size <= MAX_HEAD_SIZE:
        problems.append(
            f"the model's head size {head_size} is outside the NPU paged attention's "
            f"(0, {MAX_HEAD_SIZE}]"
        )
    elif block_size * head_size > MAX_BLOCK_X_HEAD:
        problems.append(
            f"ScheduleConfig.cacheBlockSize {block_size} x head size {head_size} = "
            f"{block_size * head_size} is over the NPU paged attention's 128 x 128 = "
            f"{MAX_BLOCK_X_HEAD}"
        )
    if problems:
        raise ValueError("; ".join(problems))


@dataclass(slots=True)
class _StepArgs:
    """Per-step kernel arguments in the dtypes and devices the kernels want."""

    slots: torch.Tensor  # [T] int32: ReshapeAndCache's slot_indices are int32
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] int32 (ATB blockTables)
    decode_lens: torch.Tensor | None  # [Bd] int32 on the host (ATB contextLens is a CPU tensor)
    prefill_tables: torch.Tensor | None  # [Bp, max_blocks] int32 (FIA block_table)
    cu_query: list[int] | None  # TND actual_seq_lengths: cumulative query lengths
    kv_lens: list[int] | None  # actual_seq_lengths_kv (see _step_args)


_last_step: list = [None, None]  # (metadata, its _StepArgs)
_masks: dict[torch.device, torch.Tensor] = {}


def _step_args(md: AttentionMetadata) -> _StepArgs:
    """Convert the metadata once per step: every layer reuses it, and the host lists below cost
    a device-to-host sync that should not happen once per layer."""
    if _last_step[0] is md:
        return _last_step[1]
    block_size = md.kv_caches[0][0].shape[1]
    cu_query = kv_lens = prefill_tables = None
    prompts, decodes = md.prompts, md.decodes
    if prompts is not None:
        prefill_tables = prompts.block_tables
        if prefill_tables is not None and block_size % FIA_BLOCK_ALIGN:
            raise ValueError(
                f"the NPU backend needs block_size to be a multiple of {FIA_BLOCK_ALIGN} "
                f"(FIA page attention), got {block_size}"
            )
        cu_query = list(accumulate(prompts.query_lens.tolist()))
        # Paged FIA reads actual_seq_lengths_kv per sequence (vllm-ascend passes seq_lens_list
        # there); unpaged TND K/V are packed like the queries, so their lengths are cumulative
        # too (vllm-ascend's PrefillNoCache passes actual_seq_lengths_q for both).
        if prefill_tables is not None:
            kv_lens = prompts.context_lens.tolist()
        else:
            kv_lens = cu_query
    args = _StepArgs(
        slots=md.slot_mapping.to(torch.int32),
        decode_tables=None if decodes is None else _int32(decodes.block_tables),
        decode_lens=None if decodes is None else decodes.context_lens.to("cpu", torch.int32),
        prefill_tables=_int32(prefill_tables),
        cu_query=cu_query,
        kv_lens=kv_lens,
    )
    _last_step[0], _last_step[1] = md, args
    return args


def _int32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.int32)


def _causal_mask(device: torch.device) -> torch.Tensor:
    """1 above the diagonal = masked. With sparse_mode=3 (rightDownCausal) FIA aligns it to the
    bottom-right corner of each sequence: of a chunk of q queries over kv keys, query i sees keys
    j <= kv - q + i, i.e. every cached key plus the causal part of the chunk, our rule exactly.
    int8 like vllm-ascend's AttentionMaskBuilder.get_splitfuse_attn_mask (the doc allows bool,
    int8, uint8)."""
    mask = _masks.get(device)
    if mask is None:
        mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu_(1).to(torch.int8)
        mask = _masks[device] = mask.to(device)
    return mask


def npu_paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    import torch_npu

    md: AttentionMetadata = kwargs["attn_metadata"]
    args = _step_args(md)
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # The kernels reject strided inputs, hence the copies out of HF's [1, heads, T, D] views.
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).to(k_cache.dtype).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).to(v_cache.dtype).contiguous()
    num_heads = q.shape[1]
    scale = head_dim**-0.5 if scaling is None else float(scaling)

    # ND cache [num_blocks, block_size, Hkv, D], token t goes to block slot // block_size at
    # offset slot % block_size: the layout vllm-ascend allocates and hands to this op (its
    # A2/A3 adaptor now calls npu_scatter_pa_kv_cache(cache_mode="Norm") on the same layout).
    torch_npu._npu_reshape_and_cache(
        key=k, value=v, key_cache=k_cache, value_cache=v_cache, slot_indices=args.slots
    )
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        # ATB PagedAttention: query [B, H, D], 4-D ND caches, GQA via num_kv_heads, writes `out`.
        torch_npu._npu_paged_attention(
            query=q[:nd],
            key_cache=k_cache,
            value_cache=v_cache,
            num_kv_heads=num_kv_heads,
            num_heads=num_heads,
            scale_value=scale,
            block_table=args.decode_tables,
            context_lens=args.decode_lens,
            out=out[:nd],
        )
    if args.cu_query is not None:
        if args.prefill_tables is None:  # fresh prompts: their own K/V is all there is
            keys, values, paged = k[nd:], v[nd:], {}
        else:
            # Page attention wants (num_blocks, block_size, Hkv * D) caches: a free view of ours.
            keys = k_cache.view(num_blocks, block_size, -1)
            values = v_cache.view(num_blocks, block_size, -1)
            paged = {"block_table": args.prefill_tables, "block_size": block_size}
        # `scale` is the keyword in torch_npu >= 2.5 docs and vllm-ascend (older: scale_value).
        o, _ = torch_npu.npu_fused_infer_attention_score(
            q[nd:],
            keys,
            values,
            atten_mask=_causal_mask(q.device),
            actual_seq_lengths=args.cu_query,
            actual_seq_lengths_kv=args.kv_lens,
            num_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            scale=scale,
            input_layout="TND",
            sparse_mode=3,
            **paged,
        )
        out[nd:] = o.view(-1, num_heads, head_dim)
    return out.unsqueeze(0), None


def register() -> str:
    return attention.register(ATTENTION_NAME, npu_paged_attention)
