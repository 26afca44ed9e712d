"""Sampler statistics on synthetic logits: no model needed."""

import pytest
import torch

from serve_app.engine.backends.cpu.argmax import row_argmax
from serve_app.engine.params import SamplingParams
from serve_app.engine.sampler import Sampler, SampleRow

VOCAB = 151936


def _rows(params, n=1, output_ids=None, prompt_ids=None, seeds=None):
    rows = []
    for i in range(n):
        generator = None
        if seeds is not None:
            generator = torch.Generator().manual_seed(seeds[i])
        rows.append(SampleRow(params, prompt_ids or [], list(output_ids or []), generator))
    return rows


def _logits(n, seed=0, vocab=VOCAB, scale=3.0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_temperature_zero_and_do_sample_false_are_greedy():
    logits = _logits(4)
    sampler = Sampler()
    for params in (SamplingParams(temperature=0), SamplingParams(do_sample=False)):
        result = sampler(logits, _rows(params, 4))
        assert result.token_ids == logits.argmax(1).tolist()


def test_top_k_never_emits_a_token_outside_the_k_best():
    logits = _logits(1, scale=0.5)  # flat: sampling without top-k would roam the vocabulary
    allowed = set(logits[0].topk(5).indices.tolist())
    sampler = Sampler(seed=1)
    rows = _rows(SamplingParams(temperature=1.0, top_k=5), 64)
    seen = set()
    for _ in range(4):  # 256 draws: a sixth token let through would all but surely show
        seen.update(sampler(logits.expand(64, -1), rows).token_ids)
    assert seen <= allowed
    assert len(seen) > 1  # it still samples


def test_top_p_never_emits_a_token_outside_the_nucleus():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([3.0, 2.5, 2.0, -1.0])
    probs = logits.softmax(1)[0]
    top_p = float(probs[:2].sum()) + 1e-4  # nucleus: tokens 0, 1 and 2 (2 crosses the mass)
    sampler = Sampler(seed=2)
    rows = _rows(SamplingParams(temperature=1.0, top_p=top_p), 64)
    seen = set()
    for _ in range(4):
        seen.update(sampler(logits.expand(64, -1), rows).token_ids)
    assert seen == {0, 1, 2}


def test_top_k_at_or_above_vocab_is_off():
    logits = _logits(1, scale=0.1)
    rows = _rows(SamplingParams(temperature=1.0, top_k=VOCAB), 256)
    tokens = Sampler(seed=3)(logits.expand(256, -1), rows).token_ids
    assert len(set(tokens)) > 200


def test_rows_mix_greedy_sampling_and_filters_independently():
    logits = _logits(3, scale=0.5)
    logits[2, 5] = 20.0  # row 2: one token holds almost all the mass
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.01),
    ]
    rows = [SampleRow(p, [], [], None) for p in params]
    for _ in range(20):
        tokens = Sampler()(logits, rows).token_ids
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in logits[1].topk(3).indices.tolist()
        assert tokens[2] == 5  # a 1 % nucleus is just the dominant token


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.9
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert Sampler()(logits, _rows(greedy, output_ids=[3])).token_ids == [4]
    assert Sampler()(logits, _rows(greedy, prompt_ids=[3])).token_ids == [4]
    assert Sampler()(logits, _rows(SamplingParams(temperature=0))).token_ids == [3]


def test_repetition_penalty_pushes_negative_logits_further_down():
    logits = torch.full((1, 10), -5.0)
    logits[0, 3] = -1.0
    logits[0, 4] = -1.2
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert Sampler()(logits, _rows(params, output_ids=[3])).token_ids == [4]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.5
    presence = SamplingParams(temperature=0, presence_penalty=1.0)
    assert Sampler()(logits, _rows(presence, output_ids=[3])).token_ids == [4]
    # frequency scales with the count: once costs 0.4, three times 1.2
    frequency = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert Sampler()(logits, _rows(frequency, output_ids=[3])).token_ids == [3]
    assert Sampler()(logits, _rows(frequency, output_ids=[3, 3, 3])).token_ids == [4]
    # presence/frequency apply to generated tokens only, not to the prompt
    assert Sampler()(logits, _rows(presence, prompt_ids=[3])).token_ids == [3]


def test_seeded_rows_are_reproducible_whatever_shares_the_batch():
    logits = _logits(1, scale=0.3)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler()(logits, _rows(params, seeds=[11])).token_ids
    crowd_logits = torch.cat([_logits(3, seed=9, scale=0.3), logits])
    crowd_rows = _rows(SamplingParams(temperature=1.0), 3) + _rows(params, seeds=[11])
    crowded = Sampler(seed=5)(crowd_logits, crowd_rows).token_ids
    assert crowded[3] == alone[0]
    other = Sampler()(logits, _rows(params, seeds=[12])).token_ids
    assert other != alone


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    rows = _rows(SamplingParams(temperature=1.0), 4000)
    tokens = torch.tensor(Sampler(seed=4)(logits.expand(4000, -1), rows).token_ids)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_low_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    rows = _rows(SamplingParams(temperature=0.1), 1000)
    tokens = Sampler(seed=4)(logits.expand(1000, -1), rows).token_ids
    assert tokens.count(0) > 950


def test_logprobs_report_the_sampled_token_and_the_top_alternatives():
    logits = _logits(2)
    result = Sampler()(logits, _rows(SamplingParams(temperature=0, logprobs=3), 2), num_top=3)
    reference = torch.log_softmax(logits, 1)
    for row in range(2):
        token = result.token_ids[row]
        assert abs(result.chosen_logprobs[row] - float(reference[row, token])) < 1e-5
        ids = [t for t, _ in result.top[row]]
        assert ids == reference[row].topk(3).indices.tolist()


class _OnlyState:
    """A constraint state (the engine's hook) that allows a fixed set of tokens."""

    min_output_tokens = 0

    def __init__(self, allowed):
        self.allowed = allowed
        self.calls = []

    def mask(self, logits_row, output_ids, remaining):
        self.calls.append((list(output_ids), remaining))
        kept = logits_row[self.allowed].clone()
        logits_row.fill_(float("-inf"))
        logits_row[self.allowed] = kept


def test_constraint_state_masks_its_own_row_only():
    logits = _logits(1).expand(64, -1)
    rows = _rows(SamplingParams(temperature=1.0), 64, output_ids=[3, 4])
    state = _OnlyState([7, 8, 9])
    for row in rows[:32]:
        row.constraint, row.remaining = state, 5
    tokens = Sampler()(logits, rows).token_ids
    assert set(tokens[:32]) <= {7, 8, 9}
    assert not set(tokens[32:]) <= {7, 8, 9}  # the unconstrained rows roam the vocabulary
    assert state.calls == [([3, 4], 5)] * 32
    assert torch.equal(logits, _logits(1).expand(64, -1))  # the caller's logits stay intact


def test_a_constraint_cannot_run_with_beam_search():
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, best_of=2, constraint=object())


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu_kernel", "torch"])
@pytest.mark.parametrize("width", [151936, 49152, 1500, 1031, 1025, 1024, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax(width, dtype, kernel, monkeypatch):
    from serve_app.engine.backends.cpu import kernels as cpu_kernels

    if kernel:
        assert cpu_kernels.op("argmax_rows") is not None, "the CPU kernels did not build"
    else:
        monkeypatch.setattr(cpu_kernels, "op", lambda name: None)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(16, width, generator=g).to(dtype)
    x[1] = 0.0  # all equal: the first index
    x[2, [7, width - 1]] = 99.0  # a tie across chunks: the first one
    x[3, width - 1] = 99.0  # the maximum in the last (maybe short) chunk
    x[4] = float("-inf")  # everything masked
    x[5, width // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
    x[6, [3, width - 2]] = float("nan")
    x[7, width - 3 :] = 50.0  # a tie at the end of the row
    x[8, [5, 9]] = torch.tensor([-0.0, 0.0]).to(dtype)  # -0 and +0 tie below everything else
    x[8, x[8] > 0] = -1.0
    x[9] = float("-inf")
    x[9, width - 1] = float("nan")  # NaN after -inf only
    x[10, :] = float("inf")  # all +inf: the first
    assert torch.equal(row_argmax(x), x.argmax(dim=1))
    strided = x[:, ::2]  # rows not contiguous: torch's path
    assert torch.equal(row_argmax(strided), strided.argmax(dim=1))


def test_greedy_rows_take_the_argmax_of_bf16_logits_without_a_float32_copy():
    logits = _logits(8, seed=3).bfloat16()
    greedy = Sampler()(logits, _rows(SamplingParams(temperature=0), n=8))
    assert greedy.token_ids == logits.float().argmax(dim=1).tolist()
    assert greedy.logprobs is None and greedy.chosen_logprobs is None
    # rows asking for more than the argmax widen the logits first, whatever their dtype
    with_logprobs = Sampler()(logits, _rows(SamplingParams(temperature=0, logprobs=2), n=8), 2)
    assert with_logprobs.token_ids == greedy.token_ids
    assert with_logprobs.logprobs.dtype == torch.float32 and len(with_logprobs.top[0]) == 2
