"""The compiled CPU decode attention (serve_app/engine/backends/cpu/kernels.py): the same results as
attention over gathered keys/values, for the shapes models have, and a clean fallback where it
cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from serve_app.engine.backends.attention import _attend, _gather
from serve_app.engine.backends.cpu import kernels as cpu_kernels


@pytest.fixture(scope="module")
def op():
    kernel = cpu_kernels.paged_decode_attention()
    assert kernel is not None, "the kernel did not build on this machine (see the log)"
    return kernel


def _paged(dtype, num_seqs, heads, kv_heads, head_dim, block_size, lens, seed=0):
    """Random caches with each sequence's blocks scattered over the pool, and its inputs."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    pool = num_seqs * width + 3
    k = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[: num_seqs * width].view(num_seqs, width)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens)


def _gathered_attention(q, k, v, tables, lens, scale):
    """Attention of each query over its sequence's first lens[b] cached positions, gathered out
    of the pages and computed by torch in the inputs' dtype."""
    block_size = k.shape[1]
    length = int(lens.max())
    positions = torch.arange(length)
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    keys, values = _gather(k, slots), _gather(v, slots)
    return _attend(q.unsqueeze(2), keys, values, mask, scale).squeeze(2)


def _reference(q, k, v, tables, lens, scale):
    """The exact answer: the same in float64."""
    return _gathered_attention(q.double(), k.double(), v.double(), tables, lens, scale)


SHAPES = [
    # heads, kv_heads, head_dim, block_size, context lengths
    (9, 3, 64, 128, [1, 2, 127, 128, 129, 300]),  # SmolLM2: grouped queries, block edges
    (4, 4, 32, 16, [5, 16, 17, 64]),  # no grouping
    (14, 2, 64, 16, [33, 1, 48]),  # Qwen2-style groups of 7
    (8, 2, 128, 16, [40, 3, 16]),  # Llama-style head size
    (4, 2, 256, 16, [9, 33]),  # the widest vectorised head size
    (8, 2, 80, 32, [7, 100]),  # a head size without a vectorised path
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", SHAPES)
def test_matches_attention_over_the_gathered_cache(
    op, dtype, heads, kv_heads, head_dim, block_size, lens
):
    q, k, v, tables, context = _paged(dtype, len(lens), heads, kv_heads, head_dim, block_size, lens)
    scale = head_dim**-0.5
    got = op(q, k, v, tables, context, scale)
    want = _reference(q, k, v, tables, context, scale)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # no further from exact than torch's own bf16 attention over the same cache
        ours = (got.double() - want).abs().max()
        torch_bf16 = _gathered_attention(q, k, v, tables, context, scale)
        theirs = (torch_bf16.double() - want).abs().max()
        assert ours <= max(1.5 * theirs, 1e-2), (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_a_strided_query_as_the_fused_projection_leaves_it(op, dtype):
    """The query heads of a fused q/k/v projection's output: rows further apart than the heads
    (no copy made), the same result as the dense query."""
    q, k, v, tables, context = _paged(dtype, 4, 9, 3, 64, 16, [1, 20, 33, 7])
    qkv = torch.randn(4, (9 + 2 * 3) * 64).to(dtype)
    qkv[:, : 9 * 64] = q.reshape(4, -1)
    strided = qkv[:, : 9 * 64].view(4, 9, 64)
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        op(strided, k, v, tables, context, 0.125), op(q, k, v, tables, context, 0.125)
    )


def test_reads_only_the_context_each_sequence_owns(op):
    """Positions past a sequence's length, and blocks not in its table, never count."""
    q, k, v, tables, context = _paged(torch.float32, 2, 4, 2, 16, 8, [5, 12])
    before = op(q, k, v, tables, context, 0.25)
    k2, v2 = k.clone(), v.clone()
    used = {(int(tables[0, 0]), t) for t in range(5)}
    used |= {(int(tables[1, t // 8]), t % 8) for t in range(12)}
    for block in range(k.shape[0]):
        for slot in range(k.shape[1]):
            if (block, slot) not in used:
                k2[block, slot] = 1e4
                v2[block, slot] = -1e4
    torch.testing.assert_close(op(q, k2, v2, tables, context, 0.25), before)


def test_uses_the_scale_it_is_given(op):
    q, k, v, tables, context = _paged(torch.float32, 3, 4, 2, 16, 8, [3, 9, 20])
    for scale in (0.1, 1.0, 2.5):
        want = _reference(q, k, v, tables, context, scale)
        got = op(q, k, v, tables, context, scale).double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_spread_past_the_float_range_of_exp(op, dtype):
    """Scores hundreds apart (a peaked softmax, as a random model's last layer gives): most
    probabilities underflow, and those near the smallest float are flushed to zero rather than
    multiplied as denormals (which only makes it faster: the bench measures that). The result is
    still attention's, and the caller's float mode (the thread's denormal handling, switched
    while the kernel runs) is left as it was."""
    q, k, v, tables, context = _paged(dtype, 3, 4, 2, 64, 16, [40, 3, 100])
    q = q * 40  # scores spread over several hundred
    got = op(q, k, v, tables, context, 0.125)
    want = _reference(q, k, v, tables, context, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    tiny = torch.tensor([1e-38]) / 100  # a denormal, unless the thread flushes them
    assert tiny.item() != 0


def test_bad_inputs_raise_instead_of_reading_out_of_bounds(op):
    q, k, v, tables, context = _paged(torch.float32, 2, 4, 2, 16, 8, [5, 12])
    with pytest.raises(RuntimeError, match="context length"):
        op(q, k, v, tables, torch.tensor([5, 17]), 1.0)  # 17 > 2 blocks of 8
    with pytest.raises(RuntimeError, match="context length"):
        op(q, k, v, tables, torch.tensor([0, 5]), 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        op(q.bfloat16(), k, v, tables, context, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        op(torch.randn(2, 3, 16), k, v, tables, context, 1.0)
    with pytest.raises(RuntimeError, match="one block table row"):
        op(q, k, v, tables[:1], context, 1.0)


def test_the_engine_decodes_through_the_kernel(op):
    from serve_app.engine.backends.metadata import build_metadata

    class Seq:
        def __init__(self, computed, table):
            self.num_computed_tokens, self.block_table = computed, table

    caches = [(torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16))]
    md = build_metadata([Seq(9, [2, 0]), Seq(3, [1])], [1, 1], caches, 8, torch.device("cpu"), op)
    assert md.decode_kernel is op and md.decodes.slots is None and md.decodes.mask is None
    assert md.decodes.context_lens.tolist() == [10, 4]


def test_switched_off_or_unbuildable_means_none_and_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.paged_decode_attention() is None
    assert "SERVE_APP_CPU_KERNELS=0" in caplog.text

    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path / "cache"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.paged_decode_attention() is None
    assert "not used" in caplog.text and "gathers" in caplog.text


def test_a_finished_build_is_loaded_without_running_the_builder(monkeypatch):
    """Once a build of this fingerprint is finished, a new process loads its library as it is:
    the builder (and its ninja, which rebuilt everything whenever a different ninja had built
    it) is not asked again."""
    from torch.utils import cpp_extension

    assert cpu_kernels.op("rms_norm") is not None  # built (or found) by this process
    assert (cpu_kernels._build_dir() / "built").exists()

    def no_build(*args, **kwargs):
        raise AssertionError("the finished build was compiled again")

    loaded = []
    monkeypatch.setattr(cpp_extension, "load", no_build)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpu_kernels, "_state", {})  # as a fresh process
    assert cpu_kernels.op("rms_norm") is not None
    assert loaded == [str(cpu_kernels._build_dir() / f"{cpu_kernels.LIBRARY}.so")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_rmsnorm(dtype):
    """float32 statistics; in bfloat16 the normalised row is rounded before the weight (as
    transformers' LlamaRMSNorm does), so the result is bit for bit transformers' own."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rms_norm = cpu_kernels.op("rms_norm")
    gen = torch.Generator().manual_seed(3)
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) * 2)
    norm = norm.to(dtype)
    wide = torch.randn(7, 200, generator=gen).to(dtype) * 3
    x = wide[:, 10:106]  # rows that are not contiguous with each other
    got = rms_norm(x, norm.weight.detach(), 1e-5)
    want = norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()
        assert (got == want).float().mean() > 0.98  # the rest one bf16 step apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_is_transformers_rotary(dtype):
    """In place, only on the heads it is given; in bfloat16 bit for bit transformers' eager
    rotary (each product rounded, then the sum), in float32 to its rounding."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = cpu_kernels.op("rotary_")
    gen = torch.Generator().manual_seed(4)
    tokens, heads, dim = 37, 12, 64
    qkv = torch.randn(tokens, (heads + 3) * dim, generator=gen).to(dtype)
    angles = torch.randn(tokens, dim // 2, generator=gen) * 5
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)  # a view into a wider row, as in a layer
    before, untouched = x.clone().transpose(0, 1), qkv[:, heads * dim :].clone()
    want, _ = apply_rotary_pos_emb(before, before, cos, sin, unsqueeze_dim=0)
    rotary(x, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(x, want.transpose(0, 1))
    else:
        torch.testing.assert_close(x, want.transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * dim :], untouched)  # only the heads it was given


def test_every_kernel_file_ships_and_counts_in_the_fingerprint():
    """A user's install compiles csrc/ itself: each file there must be package data, and each
    local header a source includes must be hashed, or an edit would reuse a stale build."""
    import re
    from pathlib import Path

    import serve_app

    pyproject = (Path(serve_app.__file__).parents[1] / "pyproject.toml").read_text()
    package = cpu_kernels.__name__.rpartition(".")[0]
    line = re.search(rf'^"{re.escape(package)}" = \[(.*)\]', pyproject, re.M)
    globs = re.findall(r'"([^"]+)"', line.group(1))
    for path in cpu_kernels.CSRC.iterdir():
        assert any(path.match(g) for g in globs), f"{path.name} is not package data"
    included = {
        cpu_kernels.CSRC / name
        for source in cpu_kernels.SOURCES
        for name in re.findall(r'#include "([^"]+)"', source.read_text())
    }
    assert included and included <= set(cpu_kernels.HEADERS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_attend_through_the_kernel_as_the_masked_path_does(op, dtype):
    # a decode, a fresh prompt and a prompt after 8 cached tokens in one step: with the kernel
    # each prompt token is a query row over its sequence's cache up to itself; without, the
    # prompts go through sdpa under a causal mask over gathered keys
    from types import SimpleNamespace

    from serve_app.engine.backends.attention import torch_paged_attention
    from serve_app.engine.backends.metadata import build_metadata

    class Seq:
        def __init__(self, computed, table):
            self.num_computed_tokens, self.block_table = computed, table

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size = 6, 2, 64, 4
    seqs, new = [Seq(9, [5, 1, 7]), Seq(0, [0, 3]), Seq(8, [2, 6, 4])], [1, 5, 4]
    caches = [tuple(torch.randn(8, size, kv_heads, dim, generator=gen).to(dtype) for _ in "kv")]
    query, key, value = (
        torch.randn(1, h, sum(new), dim, generator=gen).to(dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    outputs = []
    for kernel in (op, None):
        layer = [tuple(c.clone() for c in caches[0])]
        md = build_metadata(seqs, new, layer, size, torch.device("cpu"), kernel)
        out, _ = torch_paged_attention(
            SimpleNamespace(layer_idx=0), query, key, value, None, attn_metadata=md
        )
        outputs.append(out)
        if kernel is not None:  # rows: every token, each over its sequence up to itself
            assert md.rows.lens.tolist() == [10, 1, 2, 3, 4, 5, 9, 10, 11, 12]
            assert md.rows.tables[0].tolist() == [5, 1, 7]
            assert md.rows.tables[1:6].tolist() == [[0, 3, 0]] * 5
            assert md.rows.tables[6:].tolist() == [[2, 6, 4]] * 4
            assert md.prompts.mask is None and md.prompts.slots is None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outputs[0], outputs[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_huge_pages_are_zeros_at_a_huge_page_asking_for_huge_pages(dtype):
    from pathlib import Path

    zeros = cpu_kernels.op("zeros_on_huge_pages")
    assert zeros is not None, "the kernels did not build on this machine (see the log)"
    t = zeros([3, 1 << 20], dtype)  # 6 or 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % (1 << 21) == 0  # whole 2 MiB pages from the first byte
    assert not t.any()
    t.fill_(1)  # writable, every byte of it
    assert t.sum().item() == 3 << 20
    if Path("/sys/kernel/mm/transparent_hugepage").exists():  # Linux with THP built in
        address = t.data_ptr()  # its mapping (merged, maybe, with a neighbour just like it)
        lines = Path("/proc/self/smaps").read_text().splitlines()
        for i, line in enumerate(lines):
            span = line.split()[0].split("-")
            if len(span) == 2 and int(span[0], 16) <= address < int(span[1], 16):
                flags = next(f for f in lines[i + 1 :] if f.startswith("VmFlags:"))
                assert " hg" in flags  # MADV_HUGEPAGE
                break
        else:
            pytest.fail("no mapping holds the tensor")
    for empty in ([0], [0, 5]):
        assert zeros(empty, dtype).numel() == 0
    with pytest.raises(RuntimeError, match=">= 0"):
        zeros([-1], dtype)


def test_the_cpu_kv_cache_is_zeros_on_huge_pages():
    from serve_app.engine.backends.runner import ModelRunner
    from serve_app.engine.config import EngineConfig

    runner = ModelRunner(EngineConfig(model="demo-tiny", dtype="float32", num_kv_blocks=64))
    for k, v in runner.kv_caches:
        for cache in (k, v):
            assert cache.shape[0] == 64 and not cache.any()
            assert cache.data_ptr() % (1 << 21) == 0  # zeros_on_huge_pages' memory


def test_the_sources_compile_as_one_unit(tmp_path):
    """One translation unit includes every source, in order (each source compiled apart parsed
    the same ATen headers again)."""
    unit = cpu_kernels._one_unit(tmp_path)
    assert unit.parent == tmp_path
    assert unit.read_text().splitlines() == [f'#include "{s}"' for s in cpu_kernels.SOURCES]
