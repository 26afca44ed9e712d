"""Beam search reports per-token logprobs; engine-side non-streaming requests keep step timing."""

import pytest
import torch

from serve_app.engine import LLM, EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "demo",
        dtype="float32",
        block_size=16,
        num_kv_blocks=256,
        max_seq_len=1024,
        max_iter_times=256,
        max_input_token_len=512,
        max_prefill_tokens=512,
    )


def transformers_logprobs(model, ids, continuations):
    """transformers' log-probabilities over the vocabulary at each position of each
    continuation of `ids` (row k: the one that chose token k), in one forward pass for all of
    them: right-padded, which the earlier positions of a causal model never see."""
    width = max(map(len, continuations))
    batch = torch.tensor([ids + c + [0] * (width - len(c)) for c in continuations])
    with torch.inference_mode():
        logits = model(batch).logits.float()
    return [
        logits[i, len(ids) - 1 : len(ids) - 1 + len(c)].log_softmax(-1)
        for i, c in enumerate(continuations)
    ]


def run(llm, prompt, params):
    engine = llm.engine
    engine.add_request(EngineRequest("r", prompt, params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize(("width", "num_top"), [(2, 3), (3, 5)])
def test_beam_search_logprobs_match_transformers(llm, hf_demo, prompts, width, num_top):
    ids = prompts[3]
    params = SamplingParams(
        n=width,
        use_beam_search=True,
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        logprobs=num_top,
    )
    (output,) = llm.generate([ids], params)
    assert len(output.outputs) == width
    refs = transformers_logprobs(hf_demo, ids, [c.token_ids for c in output.outputs])
    for choice, ref in zip(output.outputs, refs, strict=True):
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids) == 6
        for step, (token, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
            assert len(lp.top) == num_top
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            ref_values, _ = ref[step].topk(num_top)
            torch.testing.assert_close(torch.tensor(values), ref_values, atol=1e-4, rtol=0)
            for alt, value in lp.top:
                assert value == pytest.approx(ref[step, alt].item(), abs=1e-4)
        total = sum(lp.logprob for lp in choice.logprobs)
        assert choice.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_beam_search_logprobs_zero_and_none(llm, prompts):
    base = dict(n=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True)
    (zero,) = llm.generate([prompts[2]], SamplingParams(logprobs=0, **base))
    for choice in zero.outputs:
        assert len(choice.logprobs) == len(choice.token_ids) and all(
            lp.top == [] for lp in choice.logprobs
        )
    (none,) = llm.generate([prompts[2]], SamplingParams(**base))
    assert all(c.logprobs is None for c in none.outputs)
    assert [c.token_ids for c in none.outputs] == [c.token_ids for c in zero.outputs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True),
    ],
    ids=["beam", "best_of"],
)
def test_non_streaming_requests_report_every_step(llm, prompts, params):
    outputs = run(llm, prompts[3], params)
    (final,) = outputs  # one output at the end
    assert final.finished
    longest = max(len(c.token_ids) for c in final.outputs)
    assert longest == 5
    history = final.step_history
    assert history is not None and len(history) == longest
    assert history[0].prefill_time_ms > 0 and history[0].decode_time_ms is None
    assert all(m.decode_time_ms > 0 and m.prefill_time_ms is None for m in history[1:])
    assert all(m.batch_size >= 1 and m.queue_wait_us >= 0 for m in history)
    assert history[-1] is final.metrics or history[-1] == final.metrics


def test_streaming_requests_have_no_step_history(llm, prompts):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    outputs = run(llm, prompts[3], params)
    assert len(outputs) == 3
    assert all(o.step_history is None for o in outputs)


def test_beam_hypotheses_ending_in_eos_keep_their_logprobs(llm, hf_demo, prompts, monkeypatch):
    ids = prompts[3]
    base = dict(n=3, use_beam_search=True, temperature=0, max_tokens=6, logprobs=1)
    (free,) = llm.generate([ids], SamplingParams(ignore_eos=True, **base))
    eos = free.outputs[1].token_ids[2]  # a token some beam picks mid-search becomes "EOS"
    monkeypatch.setattr(llm.engine, "eos_token_ids", {eos})
    (output,) = llm.generate([ids], SamplingParams(**base))
    assert any(c.finish_reason.value == "eos" for c in output.outputs)
    refs = transformers_logprobs(hf_demo, ids, [c.token_ids for c in output.outputs])
    for choice, ref in zip(output.outputs, refs, strict=True):
        assert len(choice.logprobs) == len(choice.token_ids)
        got = torch.tensor([lp.logprob for lp in choice.logprobs])
        want = ref.gather(1, torch.tensor(choice.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
