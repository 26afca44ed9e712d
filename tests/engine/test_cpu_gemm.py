"""Prepacked CPU linears: the same results as nn.Linear, any leading dims, swapped in place."""

import pytest
import torch
from torch import nn

from serve_app.engine.backends.cpu import gemm as cpu_gemm
from serve_app.engine.backends.cpu import kernels as cpu_kernels
from serve_app.engine.backends.device import cpu_has_amx_bf16, cpu_has_fast_bf16

pytestmark = pytest.mark.skipif(
    not cpu_gemm.supported(torch.device("cpu"), torch.float32),
    reason="neither oneDNN nor the streamed kernel here",
)


def needs_onednn(dtype):
    if not cpu_gemm.onednn_packs(dtype):
        pytest.skip(f"this CPU's oneDNN does not prepack {dtype} (no AVX-512 or AVX-NE-CONVERT)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 33, 64), (300, 64)])
def test_packed_linear_matches_nn_linear(dtype, shape):
    needs_onednn(dtype)
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    packed = cpu_gemm.PackedLinear(linear.weight, linear.bias)
    x = torch.randn(*shape, dtype=dtype)
    with torch.inference_mode():
        expect, got = linear(x), packed(x)
    assert got.shape == expect.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expect, rtol=tol, atol=tol)


def test_pack_linears_swaps_every_linear_and_keeps_the_output():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False))
    )
    x = torch.randn(5, 32)
    with torch.inference_mode():
        expect = model(x)
        assert cpu_gemm.pack_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    kind = cpu_gemm.StreamedLinear if cpu_gemm.streams(torch.float32) else cpu_gemm.PackedLinear
    assert isinstance(model[0], kind) and isinstance(model[2][0], kind)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_only_cpu_float32_and_bfloat16_are_packed():
    cpu = torch.device("cpu")
    assert not cpu_gemm.supported(cpu, torch.float16)
    assert not cpu_gemm.supported(torch.device("meta"), torch.float32)


streamed = pytest.mark.skipif(
    cpu_kernels.op("streamed_linear") is None,
    reason="streamed_linear is built for AVX-512 and AVX2 only",
)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@streamed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 12, 13, 32, 48, 49, 100])
@pytest.mark.parametrize("out_features", [32, 1000, 37, 61])
@pytest.mark.parametrize("in_features", [64, 33])
def test_streamed_linear_matches_nn_linear(dtype, rows, out_features, in_features):
    # rows: none (a step that samples nothing), one register tile, one and a bit, the widest
    # single pass (48) and past it (slices); out_features: whole blocks of 32 and a padded one
    # (its last 8 columns; 5; 29, which on AVX2 fill a left tile of 16 and 13 of the right one)
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
    head = cpu_gemm.StreamedLinear(linear.weight)
    x = torch.randn(rows, in_features, dtype=dtype)
    tol = TOLERANCE[dtype]
    with torch.inference_mode():
        got = head(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got, linear(x), rtol=tol, atol=tol)
        torch.testing.assert_close(head(x[None]), linear(x[None]), rtol=tol, atol=tol)


@streamed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [64, 33])
def test_a_decode_steps_rows_and_a_prefills_give_the_same_sums(dtype, in_features):
    # up to 48 rows are copied into per-tile panels before the multiplication, more are read in
    # place: the same k-ordered sums either way, bit for bit
    torch.manual_seed(0)
    layer = cpu_gemm.StreamedLinear(torch.randn(70, in_features, dtype=dtype))
    x = torch.randn(100, in_features, dtype=dtype)
    with torch.inference_mode():
        whole = layer(x)  # past 48 rows: in place
        for start, stop in [(0, 48), (48, 80), (80, 100), (7, 18)]:
            torch.testing.assert_close(layer(x[start:stop]), whole[start:stop], rtol=0, atol=0)


@streamed
def test_streamed_bfloat16_rounds_once_to_nearest_even():
    # one row times an identity-like weight: each output is one input value times a power of
    # two plus a tiny term, so the float32 sum and its bfloat16 rounding are known exactly
    weight = torch.zeros(32, 2, dtype=torch.bfloat16)
    weight[:, 0], weight[:, 1] = 1.0, 2.0**-9  # 1 + 2^-9: between bf16 steps 1 and 1 + 2^-7
    head = cpu_gemm.StreamedLinear(weight)
    x = torch.tensor([[1.0, 1.0], [1.0, 3.0], [float("nan"), 1.0]], dtype=torch.bfloat16)
    with torch.inference_mode():
        out = head(x)
    expect = (x.float() @ weight.float().t()).to(torch.bfloat16)  # float32 sum, rounded once
    torch.testing.assert_close(out[:2], expect[:2], rtol=0, atol=0)
    assert out[2].isnan().all()


pairs = pytest.mark.skipif(
    not cpu_gemm.bf16_pairs(), reason="the bfloat16 pairs are built on CPUs with AVX512-BF16"
)


@pairs
@pytest.mark.parametrize("in_features", [64, 33, 1])
def test_bfloat16_pairs_sum_both_products_of_a_pair_in_float32(in_features):
    # weights and inputs of few bits, so that every product and every partial sum is exact in
    # float32: the pairwise dot products give exactly the float32 sum, rounded once; 33 and 1
    # end on an unpaired k, added on its own
    torch.manual_seed(in_features)
    weight = torch.randint(-8, 9, (70, in_features)).to(torch.bfloat16) / 16
    x = torch.randint(-8, 9, (13, in_features)).to(torch.bfloat16) / 8
    layer = cpu_gemm.StreamedLinear(weight)
    if in_features > 1:  # the pairs' layout: k = 0 and 1 of each of block 0's columns in turn
        assert torch.equal(layer.packed[0, :2].reshape(-1), weight[:32, :2].reshape(-1))
    with torch.inference_mode():
        got = layer(x)
    expect = (x.float() @ weight.float().t()).to(torch.bfloat16)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


@pairs
def test_bfloat16_pairs_match_onednn_on_the_same_cpu():
    # the same VDPBF16PS sums as oneDNN's bfloat16 GEMM on a CPU with bfloat16 arithmetic: the
    # engine's results do not depend on which of the two multiplies
    needs_onednn(torch.bfloat16)
    torch.manual_seed(0)
    weight = torch.randn(300, 512, dtype=torch.bfloat16) / 16
    x = torch.randn(32, 512, dtype=torch.bfloat16)
    with torch.inference_mode():
        streamed = cpu_gemm.StreamedLinear(weight)(x)
        packed = cpu_gemm.PackedLinear(weight)(x)
    mismatched = (streamed != packed).float().mean().item()
    assert mismatched < 0.01, mismatched


@streamed
def test_streamed_linear_reads_strided_rows():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    head = cpu_gemm.linear(linear.weight)
    x = torch.randn(10, 128)[:, ::2]  # every other column: not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(head(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [cpu_gemm.PackedLinear, cpu_gemm.StreamedLinear])
@pytest.mark.parametrize("rows", [1, 13, 100])  # one tile, two, several slices of rows
def test_the_fused_forms_match_their_unfused_ops(kind, dtype, rows):
    if kind is cpu_gemm.StreamedLinear and cpu_kernels.op("streamed_linear") is None:
        pytest.skip("streamed_linear is built for AVX-512 and AVX2 only")
    if kind is cpu_gemm.PackedLinear:
        needs_onednn(dtype)
    torch.manual_seed(rows)
    linear = nn.Linear(64, 84, bias=True).to(dtype)  # 84: a last block of 20 (16 + 4) columns
    layer = kind(linear.weight, linear.bias)
    x = torch.randn(rows, 64, dtype=dtype)
    other = torch.randn(rows, 168, dtype=dtype)[:, 84:]  # rows 168 apart: not contiguous
    columns_apart = other.t().contiguous().t()  # each column contiguous instead
    # float32 sums rounded once: what each fused form computes before its one rounding
    exact = x.float() @ linear.weight.float().t() + linear.bias.float()
    tol = TOLERANCE[dtype]
    with torch.inference_mode():
        for got, expect in [
            (layer(x), exact),
            (layer.add(x, other), exact + other.float()),
            (layer.mul(x, other), exact * other.float()),
            (layer.silu(x), nn.functional.silu(exact)),
            (layer.add(x[None], other[None]), (exact + other.float())[None]),
            (layer.mul(x, columns_apart), exact * other.float()),
        ]:
            assert got.dtype == dtype and got.shape == expect.shape
            torch.testing.assert_close(got, expect.to(dtype), rtol=tol, atol=tol)


@streamed
def test_the_streamed_epilogue_rounds_once_in_bfloat16():
    # x @ W^T = 1 + 2^-9 (not a bfloat16 value) plus other = 2^-8 is 1 + 3 * 2^-9, which rounds
    # up to 1 + 2^-7; rounding the product first would give 1 + 2^-8, a tie that rounds to 1
    weight = torch.zeros(32, 2, dtype=torch.bfloat16)
    weight[:, 0], weight[:, 1] = 1.0, 2.0**-9
    layer = cpu_gemm.StreamedLinear(weight)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    other = torch.full((1, 32), 2.0**-8, dtype=torch.bfloat16)
    with torch.inference_mode():
        total = layer.add(x, other)
    assert (total == 1 + 2.0**-7).all()
    assert ((layer(x) + other) == 1).all()  # the two roundings the epilogue saves


@streamed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 13, 100])
def test_the_up_projection_applies_silu_to_the_gate_as_it_writes(dtype, rows):
    """mul_silu(x, gate) = (x @ W^T + b) * silu(gate), silu as torch computes it and rounded to
    the dtype first, as a separate pass would store it: float32 within a few ulps, bfloat16
    the same values but where the kernel's exponential and torch's round apart."""
    torch.manual_seed(rows)
    linear = nn.Linear(64, 84, bias=True).to(dtype)
    layer = cpu_gemm.StreamedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 64, dtype=dtype)
    gate = (torch.randn(rows, 168) * 4).to(dtype)[:, 84:]  # rows 168 apart: not contiguous
    with torch.inference_mode():
        got, unfused = layer.mul_silu(x, gate), layer.mul(x, nn.functional.silu(gate))
    assert got.dtype == dtype and got.shape == (rows, 84)
    if dtype == torch.float32:
        torch.testing.assert_close(got, unfused, rtol=4e-7, atol=1e-30)
    else:  # one bfloat16 step apart at most, and rarely
        steps = (got.float() - unfused.float()).abs() / unfused.float().abs().clamp_min(1e-30)
        assert (steps <= 2.0**-7).all() and (got != unfused).float().mean() < 0.01


@streamed
def test_silu_in_the_epilogue_at_its_limits():
    # x @ W^T = 1: the output is silu(gate) itself; torch's values at the limits (-inf gives
    # NaN, as -inf / inf), and a gate far below the float32 exponential's range gives -0
    gate = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 20.0, -20.0,
                          88.0, -89.0, 1e-3, -1e-3]])  # fmt: skip
    layer = cpu_gemm.StreamedLinear(torch.ones(gate.shape[1], 1))
    with torch.inference_mode():
        got = layer.mul_silu(torch.ones(1, 1), gate)
    expect = nn.functional.silu(gate)
    assert torch.equal(got.isnan(), expect.isnan())
    torch.testing.assert_close(got[~got.isnan()], expect[~expect.isnan()], rtol=4e-7, atol=0)


@streamed
def test_no_inputs_still_get_their_bias_and_epilogue():
    # K = 0: every sum is 0, so the result is the epilogue applied to zeros
    layer = cpu_gemm.StreamedLinear(torch.zeros(40, 0), torch.arange(40.0))
    x, other = torch.zeros(3, 0), torch.full((3, 40), 2.0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.arange(40.0).expand(3, 40))
        torch.testing.assert_close(layer.add(x, other), torch.arange(40.0) + other)
        torch.testing.assert_close(layer.mul(x, other), torch.arange(40.0) * other)


@streamed
def test_streamed_linear_checks_its_epilogue_arguments():
    kernel = cpu_kernels.op("streamed_linear")
    layer = cpu_gemm.StreamedLinear(torch.randn(64, 16))
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="other must be"):
        kernel(x, layer.packed, 64, None, torch.randn(3, 63), 1)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel(x, layer.packed, 64, torch.randn(65), None, 0)
    with pytest.raises(RuntimeError, match="unknown epilogue"):
        kernel(x, layer.packed, 64, None, torch.randn(3, 64), 4)


def test_a_layer_streams_where_the_kernel_is_faster():
    built = cpu_kernels.op("streamed_linear") is not None
    # bfloat16: widened where the CPU has no bfloat16 arithmetic, in pairs where it has vector
    # dot products, oneDNN's where it has AMX tiles
    bf16 = not cpu_has_fast_bf16() or (cpu_gemm.bf16_pairs() and not cpu_has_amx_bf16())
    for dtype, wanted in [(torch.float32, True), (torch.bfloat16, bf16)]:
        if not cpu_gemm.supported(torch.device("cpu"), dtype):
            continue  # bfloat16 on a CPU where oneDNN refuses it and the kernel is not built
        head = cpu_gemm.linear(torch.randn(96, 64, dtype=dtype))
        kind = cpu_gemm.StreamedLinear if built and wanted else cpu_gemm.PackedLinear
        assert isinstance(head, kind), dtype


def test_the_engine_packs_its_linears_on_cpu():
    from serve_app.engine.backends.runner import ModelRunner
    from serve_app.engine.config import EngineConfig

    for dtype, name in [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")]:
        if not cpu_gemm.supported(torch.device("cpu"), dtype):
            continue  # transformers' own layers: test_bfloat16_runs_where_neither_...
        runner = ModelRunner(EngineConfig(model="demo-tiny", dtype=name, num_kv_blocks=4))
        # the decoder layers are fused (q/k/v, o, gate, up and down inside each), the LM head
        # is on its own; every one of them streamed where the kernel is built and faster
        assert runner.backend.fused_layers == runner.hf_config.num_hidden_layers
        assert runner.backend.packed_linears == 1
        kind = cpu_gemm.StreamedLinear if cpu_gemm.streams(dtype) else cpu_gemm.PackedLinear
        assert isinstance(runner.lm_head, kind)
        layer = runner.model.get_decoder().layers[0]
        for part in ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            assert isinstance(getattr(layer, part), kind), (name, part)
        assert not any(isinstance(m, nn.Linear) for m in runner.model.get_decoder().modules())


def test_bfloat16_runs_where_neither_onednn_nor_the_kernel_takes_it(monkeypatch):
    # a CPU without AVX-512 (oneDNN refuses to prepack bfloat16 there) and without the compiled
    # kernel (no C++ compiler): the engine keeps transformers' own layers instead of failing
    from serve_app.engine.llm import LLM
    from serve_app.engine.params import SamplingParams

    monkeypatch.setattr(cpu_gemm, "onednn_packs", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(cpu_gemm, "streams", lambda dtype: False)
    assert cpu_gemm.supported(torch.device("cpu"), torch.float32)
    assert not cpu_gemm.supported(torch.device("cpu"), torch.bfloat16)
    llm = LLM("demo-tiny", dtype="bfloat16", num_kv_blocks=8)
    runner = llm.engine.runner
    assert runner.backend.fused_layers == 0 and runner.backend.packed_linears == 0
    [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
