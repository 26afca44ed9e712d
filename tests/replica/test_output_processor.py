"""OutputProcessor on hand-made engine outputs: the cases the random demo model never produces."""

from __future__ import annotations

import pytest

from serve_app.engine.outputs import CompletionOutput, RequestOutput
from serve_app.engine.params import FinishReason, SamplingParams
from serve_app.messages import ReplicaRequest
from serve_app.models.loader import load_tokenizer, resolve_model_path
from serve_app.replica.output_processor import OutputProcessor

EOS = 151645  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("demo-tiny"))


@pytest.mark.parametrize("include, expect_eos_text", [(False, False), (True, True)])
def test_eos_text_is_hidden_unless_asked_even_with_special_tokens_kept(
    tokenizer, include, expect_eos_text
):
    ids = tokenizer.encode("Hello there") + [EOS]
    req = ReplicaRequest(
        "r", [1, 2, 3], SamplingParams(), stream=False, skip_special_tokens=False,
        include_stop_str_in_output=include, token_texts=True,
    )  # fmt: skip
    output = RequestOutput(
        "r", [1, 2, 3],
        [CompletionOutput(0, ids, ids, finish_reason=FinishReason.EOS)],
        finished=True,
    )  # fmt: skip
    chunk = OutputProcessor(req, tokenizer).process(output)
    choice = chunk.choices[0]
    assert choice.finish_reason == "eos" and choice.token_ids == ids
    assert ("<|im_end|>" in choice.text) == expect_eos_text
    assert choice.text.startswith("Hello there")
    assert len(choice.token_texts) == len(ids)
