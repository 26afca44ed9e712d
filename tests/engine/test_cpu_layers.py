"""Fused CPU decoder layers: the logits transformers' own layers give, on Qwen2 (q/k/v biases)
and Llama shapes, over prompts, chunked prompts and decodes; other shapes keep their forward."""

import functools
import shutil

import pytest
import torch

from serve_app.engine.backends.cpu import gemm as cpu_gemm
from serve_app.engine.backends.cpu import layers as cpu_layers
from serve_app.engine.backends.runner import ModelRunner
from serve_app.engine.config import EngineConfig
from serve_app.engine.sequence import Sequence
from serve_app.models.demo import ensure_demo_model

pytestmark = [
    pytest.mark.skipif(
        not cpu_gemm.supported(torch.device("cpu"), torch.float32), reason="torch without oneDNN"
    ),
    pytest.mark.usefixtures("one_tokenizer_per_model"),
]

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random Llama (SmolLM2's shape, scaled down; weights large enough for attention to
    depend on positions) with the demo's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms that are not all ones, so a missing weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    model.save_pretrained(out)
    demo = ensure_demo_model("demo-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def runners():
    """runners(model, dtype, fused): one runner of each kind for the module, its decoder layers
    fused or transformers' own. `_steps` gives the same logits on a runner used before: each
    call writes every KV position it reads."""

    @functools.cache
    def build(model, dtype, fused):
        with pytest.MonkeyPatch.context() as patch:
            if not fused:
                patch.setattr(cpu_layers, "fuse_decoder_layers", lambda *args: 0)
            config = EngineConfig(model=model, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=32)
            return ModelRunner(config)

    return build


def _steps(runner):
    """Logits of three steps over the same sequences: two fresh prompts; one prompt's second
    chunk beside the other's first decode; two decodes. Blocks are handed out by hand."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (21, 40)]
    seqs = [Sequence(list(p), len(p)) for p in prompts]
    seqs[0].block_table, seqs[1].block_table = [4, 9], [1, 30, 7, 12]
    logits = [runner.execute(seqs, [21, 25], [0])]  # the second prompt's first chunk only
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 21, 25
    seqs[0].token_ids.append(5)
    logits.append(runner.execute(seqs, [1, 15], [0, 1]))
    seqs[0].num_computed_tokens, seqs[1].num_computed_tokens = 22, 40
    seqs[0].token_ids.append(6)
    seqs[1].token_ids.append(7)
    logits.append(runner.execute(seqs, [1, 1], [0, 1]))
    return logits


@pytest.mark.parametrize("model", ["demo-tiny", "tiny_llama"])
def test_fused_layers_give_transformers_logits(model, request, runners):
    model = request.getfixturevalue(model) if model == "tiny_llama" else model
    fused = runners(model, "float32", True)
    assert fused.backend.fused_layers == fused.hf_config.num_hidden_layers
    assert all(
        isinstance(layer, cpu_layers.FusedDecoderLayer)
        for layer in fused.model.get_decoder().layers
    )
    plain = runners(model, "float32", False)
    assert plain.backend.fused_layers == 0
    reference = _steps(plain)
    for got, expect in zip(_steps(fused), reference, strict=True):
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-5 * expect.abs().max().item())
        assert torch.equal(got.argmax(-1), expect.argmax(-1))
    # bfloat16: the fused ops round once where transformers rounds twice, so no bit equality;
    # the fused layers must come as close to the float32 logits as transformers' own do
    fused_bf16 = _steps(runners(model, "bfloat16", True))
    plain_bf16 = _steps(runners(model, "bfloat16", False))
    for got, expect, exact in zip(fused_bf16, plain_bf16, reference, strict=True):
        error, plain_error = (got - exact).abs().max(), (expect - exact).abs().max()
        assert error <= 1.5 * plain_error, (error, plain_error)


@pytest.mark.skipif(
    not cpu_gemm.streams(torch.float32), reason="the streamed kernel is not built here"
)
def test_with_the_streamed_kernel_silu_has_no_pass_of_its_own(runners, monkeypatch):
    """The up projection's GEMM applies SiLU to the gate as it writes: no separate pass over
    the gate (torch's silu is never called) for the same logits as the separate pass."""
    fused = runners("demo-tiny", "float32", True)
    assert all(layer.silu_in_up for layer in fused.model.get_decoder().layers)
    expect = _steps(runners("demo-tiny", "float32", False))

    def no_silu(*args, **kwargs):
        raise AssertionError("a separate SiLU pass")

    monkeypatch.setattr(cpu_gemm.F, "silu", no_silu)
    monkeypatch.setattr(torch.nn.functional, "silu", no_silu)
    for got, exact in zip(_steps(fused), expect, strict=True):
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-5 * exact.abs().max().item())


def _llama_layer(**overrides):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, **overrides)  # fmt: skip
    return LlamaDecoderLayer(config, 0), config.hidden_act


def test_layers_of_another_shape_keep_transformers_forward():
    assert cpu_layers.fusable(*_llama_layer())
    assert not cpu_layers.fusable(*_llama_layer(mlp_bias=True))  # biases on the MLP
    assert not cpu_layers.fusable(*_llama_layer(attention_bias=True))  # a bias on o_proj
    assert not cpu_layers.fusable(*_llama_layer(hidden_act="gelu"))
    layer, act = _llama_layer()
    layer.self_attn.q_norm = torch.nn.Identity()  # an extra norm (Qwen3's shape)
    assert not cpu_layers.fusable(layer, act)
    assert not cpu_layers.fusable(torch.nn.Linear(4, 4), "silu")
