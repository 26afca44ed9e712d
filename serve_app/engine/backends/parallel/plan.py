"""How a model is split over tensor-parallel ranks.

Which layers are split, and how, is transformers' own tensor-parallel plan for the model
(`base_model_tp_plan`: q/k/v and the MLP's gate and up "colwise", the attention's o and the
MLP's down "rowwise", for Llama- and Qwen2-shaped models). transformers applies its plan by
turning the weights into DTensors; the engine's CPU layers pack plain weight tensors and its
attention writes a paged cache, so the plan is applied here to plain tensors instead: `parts`
names each rank's slice of each split weight, which load.py reads from the checkpoint (or `apply`
cuts from a model loaded whole):

* colwise: each rank keeps its slice of the output features (its query heads; its share of the
  MLP's intermediate size) and of the bias;
* the K and V projections are sliced by KV head; where there are fewer KV heads than ranks, each
  rank keeps the one KV head its query heads read (replicated, as vLLM does), so the ranks' KV
  caches together hold each KV head `world / kv_heads` times;
* rowwise: each rank keeps its slice of the input features; the partial outputs are summed
  across ranks (an all-reduce) before the residual is added, and a bias only on rank 0;
* the embeddings, the norms and the LM head stay whole on every rank (the hidden state after
  each all-reduce is the same everywhere; only rank 0 computes logits and samples).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# transformers' plan styles this applies; any other in a model's plan refuses the model
STYLES = ("colwise", "rowwise")


@dataclass(frozen=True)
class Split:
    """One rank's part of the model: its heads and the size of its caches."""

    rank: int
    world: int
    heads: int  # query heads this rank computes
    kv_heads: int  # KV heads this rank holds (and caches)
    kv_head_start: int  # the first of them, among the model's


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def model_plan(hf_config) -> dict[str, str]:
    """transformers' plan for the model's decoder ("layers.*.self_attn.q_proj": "colwise", ...)."""
    return dict(getattr(hf_config, "base_model_tp_plan", None) or {})


def problems(hf_config, world: int) -> list[str]:
    """Why the model cannot run over `world` ranks (empty: it can), naming worldSize and the
    model's numbers."""
    if world == 1:
        return []
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    model = getattr(hf_config, "model_type", "this model")
    plan = model_plan(hf_config)
    found = []
    if not plan:
        found.append(
            f"worldSize {world}: {model} models have no tensor-parallel plan in transformers; "
            "serve them with worldSize 1"
        )
    others = sorted({style for style in plan.values() if style not in STYLES})
    if others:
        found.append(
            f"worldSize {world}: {model}'s tensor-parallel plan uses {', '.join(others)}; the "
            f"engine applies {' and '.join(STYLES)} only: serve it with worldSize 1"
        )
    if heads % world:
        found.append(
            f"worldSize {world} does not divide the model's {heads} attention heads; "
            f"worldSize may be {', '.join(map(str, _divisors(heads)))}"
        )
    elif (kv % world) if kv >= world else (world % kv):
        fits = [d for d in _divisors(heads) if kv % d == 0 or d % kv == 0]
        found.append(
            f"worldSize {world} and the model's {kv} KV heads: one must divide the other "
            f"(worldSize may be {', '.join(map(str, fits))})"
        )
    intermediate = getattr(hf_config, "intermediate_size", 0)
    if intermediate % world:
        found.append(f"worldSize {world} does not divide the model's MLP size ({intermediate})")
    return found


def split_for(hf_config, rank: int, world: int) -> Split:
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if world == 1:
        return Split(0, 1, heads, kv, 0)
    kv_heads = max(1, kv // world)
    # with fewer KV heads than ranks, rank r's query heads read KV head r // (world // kv)
    kv_start = rank * kv_heads if kv >= world else rank // (world // kv)
    return Split(rank, world, heads // world, kv_heads, kv_start)


@dataclass(frozen=True)
class Part:
    """The part of one weight a rank keeps: `count` rows (dim 0) or columns (dim 1) from
    `start`; count 0 drops the tensor (a rowwise layer's bias, kept on rank 0 only)."""

    dim: int
    start: int
    count: int

    def take(self, t):
        """This part of `t`: a torch tensor, or a safetensors slice (read from the file only
        then)."""
        if self.dim == 0:
            return t[self.start : self.start + self.count]
        return t[:, self.start : self.start + self.count]


def _split_linears(model: nn.Module):
    """(name, Linear, style) of every decoder Linear the model's plan splits."""
    decoder = model.get_decoder()
    for pattern, style in model_plan(model.config).items():
        for name, module in decoder.named_modules():
            if fnmatch.fnmatchcase(name, pattern) and isinstance(module, nn.Linear):
                yield name, module, style


def parts(model: nn.Module, split: Split) -> dict[str, Part]:
    """The part of each split weight `split`'s rank keeps, by its name in the model's state
    dict ("model.layers.0.self_attn.q_proj.weight"); read from the (whole) shapes of `model`,
    whose weights may be on the meta device."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    decoder = model.get_decoder()
    prefix = next((f"{n}." for n, m in model.named_modules() if m is decoder and n), "")
    found = {}
    for name, module, style in _split_linears(model):
        key = f"{prefix}{name}"
        if style == "rowwise":
            width = module.in_features // split.world
            found[f"{key}.weight"] = Part(1, split.rank * width, width)
            bias = Part(0, 0, module.out_features if split.rank == 0 else 0)
        else:
            if name.endswith(("k_proj", "v_proj")):
                rows = Part(0, split.kv_head_start * head_dim, split.kv_heads * head_dim)
            else:
                count = module.out_features // split.world
                rows = Part(0, split.rank * count, count)
            found[f"{key}.weight"] = bias = rows
        if module.bias is not None:
            found[f"{key}.bias"] = bias
    return found


def set_part(model: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Put `tensor` (this rank's part, or None: dropped) in place of the parameter `name`,
    keeping the Linear's in/out features in step with its weight."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    module._parameters[attr] = (
        None if tensor is None else nn.Parameter(tensor.contiguous(), requires_grad=False)
    )
    if attr == "weight" and isinstance(module, nn.Linear):
        module.out_features, module.in_features = tensor.shape


def apply(model: nn.Module, split: Split) -> int:
    """Slice a wholly loaded model's split weights in place for `split`'s rank (`load.load_part`
    reads only the parts from the checkpoint instead). How many tensors were split."""
    found = parts(model, split)
    state = model.state_dict(keep_vars=True)
    for name, part in found.items():
        kept = part.take(state[name].detach()).clone() if part.count else None
        set_part(model, name, kept)
    return len(found)


def mark_reduce(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Give every rowwise Linear the all-reduce that sums its partial outputs (`tp_reduce`: the
    CPU backend's fused layers call it, `reduce_outputs` hooks it onto transformers' own)."""
    marked = 0
    for _name, module, style in _split_linears(model):
        if style == "rowwise":
            module.tp_reduce = reduce
            marked += 1
    return marked


def reduce_outputs(model: nn.Module) -> int:
    """Hook the all-reduce onto every rowwise Linear still in the model (the ones no fused layer
    took over): its partial output is summed across ranks before anything adds to it."""
    hooked = 0
    for module in model.modules():
        reduce = getattr(module, "tp_reduce", None)
        if reduce is not None and isinstance(module, nn.Linear):
            module.register_forward_hook(lambda _m, _args, out, reduce=reduce: reduce(out))
            hooked += 1
    return hooked
