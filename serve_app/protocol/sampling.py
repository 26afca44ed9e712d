"""What the API families share: finish-reason words and the sampling mapping.

Engine finish reasons (`FinishReason` values, as they arrive in `ChoiceDelta.finish_reason`) map
onto each family's words here, once. MindIE's words (/infer, chat, Triton) are eos_token /
stop_sequence / length; the vLLM-style completions route says stop / length
(docs/apis.md#openai-completions).
"""

from __future__ import annotations

from typing import Any

from serve_app.engine.params import SamplingParams
from serve_app.messages import ReplicaRequest, TokenizedPrompt
from serve_app.protocol.defaults import ServerDefaults

MINDIE_FINISH = {
    "eos": "eos_token",
    "stop_token": "stop_sequence",
    "stop_string": "stop_sequence",
    "length": "length",
    "aborted": "stop_sequence",  # cancelled or stopped: MindIE reports both as stop_sequence
    "timeout": "stop_sequence",
}
OPENAI_FINISH = {
    "eos": "stop",
    "stop_token": "stop",
    "stop_string": "stop",
    "length": "length",
    "aborted": "abort",
    "timeout": "abort",
}


def mindie_finish(reason: str | None) -> str | None:
    return None if reason is None else MINDIE_FINISH.get(reason, reason)


def openai_finish(reason: str | None) -> str | None:
    return None if reason is None else OPENAI_FINISH.get(reason, reason)


def sampling_params(
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    best_of: int | None = None,
    use_beam_search: bool = False,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """Validated request values -> SamplingParams; None means "the engine default".

    top_k -1 / 0 / >= vocab means off: a top_k of the vocabulary size keeps every token
    (docs/apis.md#common-rules).
    do_sample false means greedy whatever the temperature; temperature 0 means greedy.
    """
    n = n or 1
    return SamplingParams(
        n=n,
        best_of=best_of if best_of is not None else n,
        use_beam_search=use_beam_search,
        temperature=1.0 if temperature is None else float(temperature),
        do_sample=True if do_sample is None else bool(do_sample),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
        repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
        presence_penalty=0.0 if presence_penalty is None else float(presence_penalty),
        frequency_penalty=0.0 if frequency_penalty is None else float(frequency_penalty),
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=[t for t in (stop_token_ids or []) if 0 <= t <= 2**31 - 1],
        logprobs=logprobs,
    )


def parameters_request(
    request_id: str,
    prompt: TokenizedPrompt,
    defaults: ServerDefaults,
    params: Any,
    *,
    seed: int | None,
    max_new_tokens: int,
    **fields: Any,
) -> ReplicaRequest:
    """The replica request of a MindIE-style `parameters` object: /infer and Triton generate
    share its field names (temperature, top_k, top_p, do_sample, repetition_penalty, priority,
    timeout); their ranges differ and stay in each family's model. `fields`: the rest of the
    ReplicaRequest (stop strings, streaming flags)."""
    return ReplicaRequest(
        request_id=request_id,
        prompt_token_ids=prompt.prompt_token_ids,
        params=sampling_params(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            do_sample=params.do_sample,
            seed=seed,
            repetition_penalty=params.repetition_penalty,
            max_tokens=defaults.limits.max_output_tokens(max_new_tokens),
        ),
        priority=defaults.priority_of(params.priority),
        timeout_s=defaults.timeout_of(params.timeout),
        **fields,
    )


def sampled_request(
    request_id: str,
    prompt: TokenizedPrompt,
    defaults: ServerDefaults,
    *,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    stream: bool | None,
    top_k: int | None = None,
    n: int | None = None,
    logprobs: int | None = None,
    stop: list[str] | None = None,
    constraint: Any = None,
) -> ReplicaRequest:
    """The replica request of a Databricks-style body (chat, completions, Responses): their
    few sampling fields, the server's priority, max_tokens capped at maxIterTimes; `logprobs`
    (top-N) also asks for the tokens' texts."""
    params = sampling_params(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_tokens=defaults.limits.max_output_tokens(max_tokens),
        n=n,
        logprobs=logprobs,
    )
    params.constraint = constraint
    return ReplicaRequest(
        request_id=request_id,
        prompt_token_ids=prompt.prompt_token_ids,
        params=params,
        priority=defaults.priority,
        stop=stop or [],
        stream=bool(stream),
        logprob_texts=logprobs is not None,
    )
