"""What the engine test modules share: checks on outputs and on a drained engine (not tests)."""

import torch


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_matches_transformers(outputs, reference, atol=2e-4):
    """Same tokens as transformers, and the same log-probability for each (up to atol)."""
    ref_tokens, ref_logprobs = reference
    assert tokens(outputs) == ref_tokens
    for output, expected in zip(outputs, ref_logprobs, strict=True):
        got = torch.tensor([lp.logprob for lp in output.outputs[0].logprobs])
        torch.testing.assert_close(got, torch.tensor(expected), atol=atol, rtol=0)


def assert_idle(llm):
    """Every KV block back in the pool and no request left."""
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert not llm.engine.requests


def run_to_end(engine):
    """Step an LLMEngine until no request is left; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done
