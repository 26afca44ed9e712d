"""Decoder layers of Llama-shaped models, fused for CPU.

transformers' eager decoder layer runs ~45 small ops per layer per step (three projections for
q, k and v, two for gate and up, an RMSNorm of nine ops twice, a rotary embedding of ten, SiLU,
the product and two residual adds). On a small model with many layers (SmolLM2-135M: 30 layers
of width 576) the dispatch of those ops and their passes over memory cost as much as the
matrix products. `FusedDecoderLayer` computes the same layer with:

* one GEMM for q, k and v together, and one each for gate, up (the product with the activated
  gate applied by the GEMM), o and down (each adding the residual as it writes its output): five
  GEMMs and no separate product or add, on cpu_gemm.linear's layers (oneDNN's prepacked GEMM,
  which applies SiLU as the gate's GEMM writes, or the engine's streamed kernel where it is built
  and faster, which applies it to the gate as the up projection's GEMM reads it);
* RMSNorm as transformers computes it (float32 statistics, cast back, then the weight), in one
  pass by the engine's compiled `rms_norm` (kernels.py), else torch's fused `rms_norm`;
* the rotary embedding applied once to q and k together, in place in one pass by the compiled
  `rotary_`, else in eager torch ops.

Attention is the model's attention implementation, looked up on every call as transformers
does, so a backend swapped in later (`set_attn_implementation`) is the one used.

The arithmetic is transformers' except where a GEMM fuses an op: in float32 the results differ
by float32 rounding, in bfloat16 the fused ops round once instead of twice. Layers of another
shape (extra norms, biases on o or the MLP, another activation, sliding windows) keep
transformers' own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from serve_app.engine.backends.cpu import gemm as cpu_gemm
from serve_app.engine.backends.cpu import kernels as cpu_kernels

# Decoder layer classes whose forward this module reproduces: pre-norm RMSNorm, attention with
# q/k/v/o projections and a rotary embedding given by the model, a SiLU-gated MLP.
FUSABLE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _is_plain_linear(module: nn.Module, bias: bool | None = None) -> bool:
    return type(module) is nn.Linear and (bias is None or (module.bias is not None) == bias)


def fusable(layer: nn.Module, hidden_act: str | None) -> bool:
    """Whether `layer` has exactly the shape FusedDecoderLayer computes."""
    if type(layer).__name__ not in FUSABLE_LAYERS or hidden_act not in ("silu", "swish"):
        return False
    if {name for name, _ in layer.named_children()} != _LAYER_PARTS:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if {name for name, _ in attn.named_children()} != _ATTENTION_PARTS:
        return False
    if {name for name, _ in mlp.named_children()} != _MLP_PARTS:
        return False
    if getattr(attn, "sliding_window", None) is not None:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(n).__name__.endswith("RMSNorm") for n in norms):
        return False
    if not all(hasattr(n, "variance_epsilon") for n in norms):
        return False
    return all(_is_plain_linear(getattr(attn, p)) for p in ("q_proj", "k_proj", "v_proj")) and (
        _is_plain_linear(attn.o_proj, bias=False)
        and all(_is_plain_linear(getattr(mlp, p), bias=False) for p in _MLP_PARTS - {"act_fn"})
    )


class _RMSNorm(nn.Module):
    """transformers' RMSNorm: statistics in float32, cast back to the input dtype, times weight."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight.detach()
        self.eps = float(norm.variance_epsilon)
        self.shape = (self.weight.shape[0],)
        self.kernel = cpu_kernels.op("rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == self.weight.dtype and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


def _qkv_bias(attn: nn.Module) -> torch.Tensor | None:
    """The q, k and v biases end to end (zeros for a projection without one), or None."""
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    if all(p.bias is None for p in projections):
        return None
    return torch.cat(
        [p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0]) for p in projections]
    ).detach()


class FusedDecoderLayer(nn.Module):
    """One decoder layer over a packed step: hidden [1, T, hidden] -> [1, T, hidden]."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.config = attn.config  # the model's: its attention implementation is looked up per call
        self.layer_idx = attn.layer_idx
        self.attention_type = getattr(layer, "attention_type", "full_attention")
        self.scaling = attn.scaling
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.input_layernorm = _RMSNorm(layer.input_layernorm)
        self.post_attention_layernorm = _RMSNorm(layer.post_attention_layernorm)
        with torch.no_grad():
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            self.qkv_proj = cpu_gemm.linear(qkv, _qkv_bias(attn))
        self.o_proj = cpu_gemm.linear(attn.o_proj.weight)
        self.gate_proj = cpu_gemm.linear(mlp.gate_proj.weight)
        self.up_proj = cpu_gemm.linear(mlp.up_proj.weight)
        self.down_proj = cpu_gemm.linear(mlp.down_proj.weight)
        # the streamed kernel applies SiLU to the gate as the up projection writes its product
        self.silu_in_up = isinstance(self.up_proj, cpu_gemm.StreamedLinear)
        self.rotary = cpu_kernels.op("rotary_")
        # tensor parallelism: o and down give partial sums, added up across the ranks before
        # the residual (engine/parallel/plan.py); None on one device
        self.reduce = getattr(attn.o_proj, "tp_reduce", None)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states[0]
        num_tokens = residual.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(self.input_layernorm(residual))
        qk = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
        cos, sin = (t[0] for t in position_embeddings)  # [T, D]
        if self.rotary is not None and cos.dtype == qk.dtype:
            self.rotary(qk, cos.contiguous(), sin.contiguous())  # in place, in qkv
        else:
            first, second = qk.chunk(2, dim=-1)
            qk = qk * cos.unsqueeze(1) + torch.cat((-second, first), dim=-1) * sin.unsqueeze(1)
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (qk[:, :heads], qk[:, heads:], v))
        out, _ = attention(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        out = out.reshape(num_tokens, heads * dim)
        hidden = self._project(self.o_proj, out, residual)
        normed = self.post_attention_layernorm(hidden)
        if self.silu_in_up:
            gated = self.up_proj.mul_silu(normed, self.gate_proj(normed))
        else:  # oneDNN applies the activation as the gate's GEMM writes
            gated = self.up_proj.mul(normed, self.gate_proj.silu(normed))
        return self._project(self.down_proj, gated, hidden).unsqueeze(0)

    def _project(self, linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """linear(x) + residual; the GEMM adds it as it writes, unless the ranks sum first."""
        if self.reduce is None:
            return linear.add(x, residual)
        return self.reduce(linear(x)).add_(residual)


def fuse_decoder_layers(decoder: nn.Module, hidden_act: str | None) -> int:
    """Swap every fusable layer of `decoder.layers` for a FusedDecoderLayer; how many."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return 0
    count = 0
    for i, layer in enumerate(layers):
        if fusable(layer, hidden_act):
            layers[i] = FusedDecoderLayer(layer)
            count += 1
    return count
