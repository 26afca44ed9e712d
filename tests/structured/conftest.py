"""Fixtures of the structured-output tests."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch on one thread while a module of these tests runs (the engine process of
    test_structured_engine.py inherits it): they run small CPU ops, on a 151936-wide logits row
    per sequence and step (mask, softmax, multinomial, isfinite) and a tiny model's forward.
    Spread over several threads, such an op costs more CPU in waking and spin-waiting threads
    than in its work, and more still on a busy machine; on one thread the outputs are the same
    (the tests' seeds give the same tokens). The previous count is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
