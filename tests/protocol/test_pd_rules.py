"""The PD rules, table-driven: token counts (TokenLimits) and the refused parameters."""

from __future__ import annotations

import pytest

from serve_app.protocol.errors import APIError
from serve_app.protocol.pd_refusals import PD_UNSUPPORTED, refuse_in_pd
from serve_app.tokenizer.limits import TokenLimits

LIMITS = TokenLimits(max_seq_len=2560, max_input_token_len=2048, max_iter_times=512)


@pytest.mark.parametrize(
    "max_tokens, total, decode",
    [
        (None, 513, 512),  # the limit comes from maxIterTimes: decode runs maxIterTimes steps
        (512, 513, 512),  # max_tokens not smaller than maxIterTimes: the same
        (100000, 513, 512),  # larger: clamped to maxIterTimes, then the same
        (511, 511, 510),  # smaller: exact
        (20, 20, 19),  # /infer_token's default max_new_tokens
        (1, 1, 0),  # the prefill's first token is all there is
    ],
)
def test_output_token_counts(max_tokens, total, decode):
    assert LIMITS.pd_total_tokens(max_tokens) == total
    assert LIMITS.pd_decode_tokens(max_tokens) == decode


@pytest.mark.parametrize("param", PD_UNSUPPORTED)
def test_each_unsupported_parameter_is_refused_in_pd_mode_only(param):
    refuse_in_pd(False, {param: True})  # standard mode: fine
    refuse_in_pd(True, {param: False})  # not given: fine
    with pytest.raises(APIError) as caught:
        refuse_in_pd(True, {param: True})
    error = caught.value
    assert error.kind == "unsupported" and error.param == param
    assert error.message == f"{param} is not supported in PD (inferMode dmi) mode"
    assert error.status("mindie") == 422 and error.status("openai") == 400
    assert error.status("triton") == 400


def test_the_first_given_parameter_is_named():
    with pytest.raises(APIError) as caught:
        refuse_in_pd(True, {"stop": False, "n": True, "logprobs": True})
    assert caught.value.param == "n"


def test_a_parameter_outside_the_rules_is_a_programming_error():
    with pytest.raises(ValueError):
        refuse_in_pd(True, {"temperature": True})
