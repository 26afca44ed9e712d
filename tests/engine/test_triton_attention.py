"""Decode attention in Triton (triton_attention), the kernel CUDA decode steps and their graphs
use. On a GPU the checks run the compiled kernel; without one, Triton's interpreter runs it,
which has to be switched on before Triton is first imported, so there the checks run in a child
process (this file as a script, with TRITON_INTERPRET=1). `test_metadata_*` runs no kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from serve_app.engine.backends.cuda import triton_attention
from serve_app.engine.backends.metadata import build_metadata

ROOT = Path(__file__).resolve().parents[2]


class Seq:
    def __init__(self, computed, table):
        self.num_computed_tokens, self.block_table = computed, table


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Row r over its first lens[r] cached positions, gathered one by one, in float32."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for r in range(q.shape[0]):
        pos = torch.arange(int(lens[r]))
        slots = tables[r][pos // block_size] * block_size + pos % block_size
        k, v = (
            c.flatten(0, 1)[slots].float().repeat_interleave(group, 1) for c in (k_cache, v_cache)
        )
        scores = torch.einsum("hd,lhd->hl", q[r].float(), k) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def check_kernel_against_reference(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    cases = [  # (dtype, heads, kv heads, head dim, block size)
        (torch.float32, 8, 2, 64, 16),
        (torch.bfloat16, 8, 2, 64, 16),
        (torch.float32, 4, 4, 80, 8),  # no grouping; a head size that is not a power of two
        (torch.bfloat16, 6, 2, 128, 32),
    ]
    for dtype, heads, kv_heads, dim, size in cases:
        blocks = 24
        k_cache, v_cache = (
            torch.randn(blocks, size, kv_heads, dim, generator=gen).to(dtype) for _ in "kv"
        )
        lens = torch.tensor([1, size - 1, size, size + 1, 2 * size + 3, 70])
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:12] for _ in lens])
        # q as a projection leaves it: [rows, H, D] viewed out of [H, rows, D]
        q = torch.randn(heads, len(lens), dim, generator=gen).to(dtype).transpose(0, 1)
        on = [t.to(device) for t in (q, k_cache, v_cache, tables, lens)]
        out = triton_attention.paged_decode_attention(*on, 0.125).cpu()
        want = reference(q, k_cache, v_cache, tables, lens, 0.125)
        assert out.dtype == dtype and out.shape == q.shape
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        else:  # the kernel sums in float32 and rounds once
            torch.testing.assert_close(out, want.to(dtype), rtol=0, atol=1e-2)


def check_attention_with_prompts_on_the_masked_path(device="cpu"):
    """A step of two decodes and two prompt chunks (one after cached tokens): with the Triton
    kernel for the decodes and the prompts still on sdpa (prompt_rows=False, as on CUDA) the
    layer's output is the gather path's."""
    from serve_app.engine.backends.attention import torch_paged_attention

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, size = 6, 2, 64, 4
    seqs = [Seq(9, [5, 1, 7]), Seq(2, [3]), Seq(0, [0, 8]), Seq(8, [2, 6, 4])]
    new = [1, 1, 5, 4]
    caches = [tuple(torch.randn(10, size, kv_heads, dim, generator=gen).to(device) for _ in "kv")]
    query, key, value = (
        torch.randn(1, h, sum(new), dim, generator=gen).to(device)
        for h in (heads, kv_heads, kv_heads)
    )
    outputs = []
    for kernel in (triton_attention.paged_decode_attention, None):
        layer = [tuple(c.clone() for c in caches[0])]
        md = build_metadata(seqs, new, layer, size, torch.device(device), kernel, False)
        out, _ = torch_paged_attention(
            SimpleNamespace(layer_idx=0), query, key, value, None, attn_metadata=md
        )
        outputs.append(out)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_compiled_kernel_on_the_gpu():
    check_kernel_against_reference("cuda")
    check_attention_with_prompts_on_the_masked_path("cuda")


@pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the compiled kernel")
def test_the_kernel_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked 2" in done.stdout


def test_metadata_with_a_decode_kernel_but_prompts_on_the_masked_path():
    seqs, new = [Seq(9, [5, 1, 7]), Seq(0, [0, 8]), Seq(8, [2, 6, 4])], [1, 5, 4]
    kernel = triton_attention.paged_decode_attention
    md = build_metadata(seqs, new, [], 4, torch.device("cpu"), kernel, prompt_rows=False)
    assert md.decode_kernel is kernel and md.num_decodes == 1
    assert md.decodes.block_tables.tolist() == [[5, 1, 7]]
    assert md.decodes.context_lens.tolist() == [10]
    assert md.decodes.slots is None and md.decodes.mask is None  # the kernel reads the pages
    assert md.rows is None  # prompts are no kernel rows
    assert md.prompts.mask is not None and md.prompts.slots is not None  # but masked sdpa
    rows = build_metadata(seqs, new, [], 4, torch.device("cpu"), kernel)  # the CPU kernel's way
    assert rows.rows.lens.tolist() == [10, 1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert rows.prompts.mask is None


if __name__ == "__main__":  # the child process of test_the_kernel_in_tritons_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_kernel_against_reference()
    check_attention_with_prompts_on_the_masked_path()
    print("checked 2")
