"""The NPU attention backend against the pure-torch one, with a fake torch_npu.

The fake implements, in plain torch, the documented semantics the backend relies on (and checks
the argument conventions: int32 slots and block tables, host-side context lengths, TND
cumulative query lengths, per-sequence paged KV lengths, the 2048x2048 causal mask of
sparse_mode 3). It cannot prove the real kernels behave so; it proves that, if they do, the
backend computes what `torch_paged_attention` computes.
"""

from __future__ import annotations

import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from serve_app.engine import attention, npu_attention
from serve_app.engine.attention_metadata import build_metadata


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
    """What the real kernel would refuse (its documented constraints)."""


class FakeTorchNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []
        # The real kernels take float16 / bfloat16 only. Comparisons of the backend's indexing
        # against the torch backend may opt into float32 (exact arithmetic on the CPU); the
        # dtype rule itself is tested with it off.
        self.allow_float32 = False

    def _limits(self, *tensors, block_size: int, head_size: int) -> None:
        """ATB PagedAttention / ReshapeAndCache constraints (ascendtb reference)."""
        allowed = {torch.float16, torch.bfloat16} | (
            {torch.float32} if self.allow_float32 else set()
        )
        if any(t.dtype not in allowed for t in tensors):
            raise KernelLimit(f"dtype {[t.dtype for t in tensors]} not float16/bfloat16")
        if block_size % 16 or not 0 < head_size <= 256 or block_size * head_size > 128 * 128:
            raise KernelLimit(f"block_size {block_size} x head_size {head_size} not supported")

    def _npu_reshape_and_cache(self, *, key, value, key_cache, value_cache, slot_indices):
        self.calls.append(("reshape_and_cache", {}))
        self._limits(key, value, key_cache, value_cache,
                     block_size=key_cache.shape[1], head_size=key_cache.shape[3])  # fmt: skip
        assert slot_indices.dtype == torch.int32
        assert key.is_contiguous() and value.is_contiguous()
        assert key_cache.dim() == 4 and key.shape[1:] == key_cache.shape[2:]
        assert key.dtype == key_cache.dtype
        block_size = key_cache.shape[1]
        slots = slot_indices.long()
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
        self._limits(query, key_cache, value_cache,
                     block_size=key_cache.shape[1], head_size=key_cache.shape[3])  # fmt: skip
        assert block_table.dtype == torch.int32 and context_lens.dtype == torch.int32
        assert context_lens.device.type == "cpu"
        assert query.is_contiguous() and query.shape[1] == num_heads
        assert key_cache.shape[2] == num_kv_heads and out.shape == query.shape
        for b, length in enumerate(context_lens.tolist()):
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
        **unsupported,
    ):
        self.calls.append(("fused_infer_attention_score", {"paged": block_table is not None}))
        self._limits(query, key, value, block_size=block_size or 128, head_size=query.shape[2])
        assert not unsupported
        assert input_layout == "TND" and sparse_mode == 3
        causal = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
        assert atten_mask.shape == (2048, 2048) and torch.equal(atten_mask.bool(), causal)
        assert all(t.is_contiguous() for t in (query, key, value))
        assert all(type(n) is int for n in actual_seq_lengths + actual_seq_lengths_kv)
        cu_q = [0, *actual_seq_lengths]
        assert cu_q == sorted(cu_q) and cu_q[-1] == query.shape[0]
        kv_heads = num_key_value_heads or num_heads
        head_dim = query.shape[2]
        assert query.shape[1] == num_heads and num_heads % kv_heads == 0
        batches = []
        if block_table is None:  # packed TND K/V, cumulative lengths
            cu_kv = [0, *actual_seq_lengths_kv]
            assert cu_kv == sorted(cu_kv) and cu_kv[-1] == key.shape[0]
            assert key.shape[1:] == (kv_heads, head_dim)
            for b in range(len(actual_seq_lengths)):
                span = slice(cu_kv[b], cu_kv[b + 1])
                batches.append((key[span], value[span]))
        else:  # page attention: (blocks, block_size, Hkv * D), per-sequence lengths
            assert block_table.dtype == torch.int32 and block_table.dim() == 2
            assert block_table.shape[0] == len(actual_seq_lengths) == len(actual_seq_lengths_kv)
            assert key.dim() == 3 and key.shape[1:] == (block_size, kv_heads * head_dim)
            assert block_size % 128 == 0
            for b, length in enumerate(actual_seq_lengths_kv):
                k = _paged(key, block_table[b], length).view(length, kv_heads, head_dim)
                v = _paged(value, block_table[b], length).view(length, kv_heads, head_dim)
                batches.append((k, v))
        out = torch.empty_like(query)
        for b, (keys, values) in enumerate(batches):
            sq, skv = cu_q[b + 1] - cu_q[b], keys.shape[0]
            i = torch.arange(sq)[:, None]
            j = torch.arange(skv)[None, :]
            rows = slice(cu_q[b], cu_q[b + 1])
            out[rows] = _attend(query[rows], keys, values, scale, j <= skv - sq + i)  # rightDown
        return out, torch.zeros(1)

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
        if md.prefill_dense:
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
    from serve_app.engine.model_runner import ModelRunner

    seen = []
    monkeypatch.setattr(npu_attention, "check_limits", lambda *args: seen.append(args))
    monkeypatch.setattr(npu_attention, "register", lambda: "npu-backend")
    runner = SimpleNamespace(
        device=SimpleNamespace(type="npu"),
        dtype=torch.float32,
        config=SimpleNamespace(block_size=128),
        kv_shape=(128, 2, 64),
    )
    assert ModelRunner._attention_backend(runner) == "npu-backend"
    assert seen == [(torch.float32, 128, 64)]


@pytest.mark.npu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_backend_on_real_npu(case, dtype):
    # The same comparison against the real kernels; runs only where torch_npu sees an NPU.
    from serve_app.engine.device import npu_available

    if not npu_available():
        pytest.skip("needs torch_npu and an Ascend NPU")
    _compare(case, 8, 2, None, device="npu", dtype=dtype, tol=2e-2)


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
        "import serve_app.engine.npu_attention as m\n"
        "assert callable(m.npu_paged_attention) and callable(m.register)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_greedy_matches_transformers_on_fake_npu(fake_npu, prompts, greedy_reference):
    # The whole engine on the demo model, attention swapped for the NPU backend: chunked
    # prefill (48-token budget) mixes decodes, fresh prompts and prompts with cached context.
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(
        "demo",
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
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
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
