"""The paged attention function's sdpa calls: which backends they may use on each device."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend

from serve_app.engine.backends import attention


def test_cuda_calls_leave_out_cudnns_per_shape_plans(monkeypatch):
    # cuDNN builds a plan per new shape, and every decode step has a new context length
    assert SDPBackend.CUDNN_ATTENTION not in attention.CUDA_BACKENDS
    assert SDPBackend.EFFICIENT_ATTENTION in attention.CUDA_BACKENDS  # takes our masks
    chosen = []

    def record(backends):
        chosen.append(backends)
        return contextlib.nullcontext()

    monkeypatch.setattr(attention, "sdpa_kernel", record)
    attention.sdpa_backends(torch.device("cuda", 0))
    assert chosen == [attention.CUDA_BACKENDS]
    attention.sdpa_backends(torch.device("cpu"))  # torch's own choice
    assert chosen == [attention.CUDA_BACKENDS]


def test_attend_asks_for_the_backends_of_the_querys_device(monkeypatch):
    devices = []

    def record(device):
        devices.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(attention, "sdpa_backends", record)
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8)
    out = attention._attend(q, k, k, None, None)
    assert out.shape == (2, 4, 1, 8) and devices == [torch.device("cpu")]


def test_attend_takes_an_output_laid_out_heads_last(monkeypatch):
    # CUDA's memory-efficient backend returns [B, H, Q, D] strided as [B, Q, H, D]: folded
    # query heads (row g * Q + i) cannot be unfolded by a view of that
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def heads_last(q, k, v, **kwargs):
        return sdpa(q, k, v, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    expected = attention._attend(q, k, v, None, None)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", heads_last)
    assert torch.equal(attention._attend(q, k, v, None, None), expected)


def test_transformers_builds_no_mask_for_the_engines_steps(monkeypatch):
    # the paged attention masks with the step's metadata; transformers' mask builders must
    # return at once for it (no argument checks, no search for packed sequences per forward)
    from transformers import masking_utils

    from serve_app.engine.llm import LLM
    from serve_app.engine.params import SamplingParams

    preprocess = masking_utils._preprocess_mask_arguments
    exits = []

    def record(*args, **kwargs):
        result = preprocess(*args, **kwargs)
        exits.append(result[0])
        return result

    monkeypatch.setattr(masking_utils, "_preprocess_mask_arguments", record)
    llm = LLM("demo-tiny", num_kv_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [out] = llm.generate([[1, 2, 3, 4]], params)
    assert len(out.outputs[0].token_ids) == 3
    assert exits and all(exits)  # a prefill and decodes: every mask builder exited early
