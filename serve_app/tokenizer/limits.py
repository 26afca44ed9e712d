"""Token-count rules of the MindIE APIs, in one place (docs/apis.md#token-count-rules).

Plain Python: the tokenizer pool checks prompts with it (a `TokenLimitError` becomes a rejection
naming the parameter), the API families take their output caps from it, and the PD flow its
token counts. Built from the app config (`TokenLimits.of`); the output cap itself is the
engine's rule (`engine.params.output_cap`), so both sides cap alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from serve_app.engine.params import output_cap
from serve_app.messages import ErrorKind, Rejection, TokenizedPrompt, TokenizeRequest

if TYPE_CHECKING:
    from serve_app.config import AppConfig

# /infer, /infer_token and Triton generate: max_new_tokens defaults to 20, as in MindIE.
# OpenAI-style max_tokens defaults to maxIterTimes instead: `TokenLimits.default_max_tokens`.
DEFAULT_MAX_NEW_TOKENS = 20
PROMPT_TOKENS_CAP = 1 << 20  # the "1MB" term of the /v1/completions prompt rule
# MindIE documents the id range as "(1, 1024*1024]", which would refuse ids 0 and 1, ordinary
# tokens in every BPE vocabulary (Qwen2: "!" and '"'; docs/apis.md#deliberate-choices).
# A MindIE client sends tokenizer output unchanged, so we accept [0, 2^20]; the vocabulary
# bound (id < vocab_size) is stricter for every real model and is the one that binds.
MAX_TOKEN_ID = 1 << 20


class TokenLimitError(ValueError):
    """A request over a token limit; `param` is the request field to name in the 4xx body."""

    def __init__(self, param: str, low: int, limit: int, actual: int, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.low = low  # inclusive bounds of the allowed range
        self.limit = limit
        self.actual = actual
        self.message = message

    def rejection(self) -> Rejection:
        return Rejection(self.param, self.message, ErrorKind.VALIDATION)


@dataclass(frozen=True, slots=True)
class TokenLimits:
    max_seq_len: int
    max_input_token_len: int
    max_iter_times: int
    truncation: bool = False
    max_position_embeddings: int | None = None  # None: config.json has none, no bound
    vocab_size: int | None = None  # None or 0 (MindIE's default when absent): id range only

    @classmethod
    def of(
        cls,
        config: AppConfig,
        max_position_embeddings: int | None = None,
        vocab_size: int | None = None,
    ) -> TokenLimits:
        """The app config's token-count rules; a model's max_position_embeddings and vocabulary
        (from its config.json) tighten them where known."""
        deploy = config.BackendConfig.ModelDeployConfig
        return cls(
            max_seq_len=deploy.maxSeqLen,
            max_input_token_len=deploy.maxInputTokenLen,
            max_iter_times=config.BackendConfig.ScheduleConfig.maxIterTimes,
            truncation=deploy.truncation,
            max_position_embeddings=max_position_embeddings,
            vocab_size=vocab_size,
        )

    def for_request(self, truncate: bool) -> TokenLimits:
        """These limits for a request that asks to cut its prompt (`truncate`) or not."""
        return replace(self, truncation=True) if truncate and not self.truncation else self

    def _with_pos(self, *bounds: int) -> int:
        mpe = self.max_position_embeddings
        return min(*bounds, mpe) if mpe else min(bounds)

    @property
    def completion_prompt_limit(self) -> int:
        # prompt: <= min(maxInputTokenLen, maxSeqLen-1, max_position_embeddings, 1MB).
        return self._with_pos(self.max_input_token_len, self.max_seq_len - 1, PROMPT_TOKENS_CAP)

    @property
    def chat_prompt_limit(self) -> int:
        # chat messages: templated tokens <= min(maxSeqLen-maxIterTimes, max_pos_emb).
        return self._with_pos(self.max_seq_len - self.max_iter_times)

    @property
    def default_max_tokens(self) -> int:
        return self.max_iter_times  # chat and completions: max_tokens defaults to maxIterTimes

    def _check_length(self, ids: Sequence[int], param: str, limit: int, rule: str) -> list[int]:
        n = len(ids)
        if 1 <= n <= limit:
            return list(ids)
        # truncation=true cuts the prompt silently; MindIE does not say which end. We keep the
        # last `limit` tokens like vLLM's truncate_prompt_tokens, because the tail (the question,
        # the chat template's assistant header) is what generation continues.
        # An empty prompt, or a limit below 1 (e.g. maxIterTimes == maxSeqLen for chat), cannot
        # be fixed by cutting and is refused even with truncation on.
        if self.truncation and n > limit >= 1:
            return list(ids[n - limit :])
        raise TokenLimitError(
            param, 1, limit, n,
            f"{param} must have between 1 and {limit} tokens ({rule}), got {n}",
        )  # fmt: skip

    def check_completion_prompt(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        rule = "min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1048576)"
        return self._check_length(ids, param, self.completion_prompt_limit, rule)

    def check_chat_prompt(self, ids: Sequence[int], param: str = "messages") -> list[int]:
        rule = "min(maxSeqLen - maxIterTimes, max_position_embeddings) after the chat template"
        return self._check_length(ids, param, self.chat_prompt_limit, rule)

    def check_token_ids(self, ids: Sequence[int], param: str = "input_id") -> list[int]:
        """/infer_token: every id in the vocabulary and [0, 2^20]; length as for completions."""
        high = MAX_TOKEN_ID
        if self.vocab_size and self.vocab_size > 0:
            high = min(high, self.vocab_size - 1)
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= high:
                raise TokenLimitError(
                    param, 0, high, token,
                    f"{param}[{i}] must be a token id in [0, {high}] (the model vocabulary), "
                    f"got {token!r}",
                )  # fmt: skip
        return self.check_completion_prompt(ids, param)

    def max_output_tokens(self, max_tokens: int | None) -> int:
        """Output tokens allowed: min(maxIterTimes, max_tokens); absent -> maxIterTimes.

        The request's own range is the protocol's to check: OpenAI-style chat refuses more than
        maxIterTimes (its range is (0, maxIterTimes]); the other routes document their output as
        min(maxIterTimes, max_tokens) and are capped here (docs/apis.md#token-count-rules).
        """
        return output_cap(self.max_iter_times, max_tokens)

    def output_budget(self, prompt_len: int, max_tokens: int | None) -> int:
        # Colocated: outputLen = min(maxSeqLen - inputLen, maxOutputLen); hitting it
        # ends the request with finish_reason "length".
        return max(0, min(self.max_seq_len - prompt_len, self.max_output_tokens(max_tokens)))

    def pd_total_tokens(self, max_tokens: int | None) -> int:
        # PD (docs/apis.md#prefilldecode-infermode-dmi-rules): P produces the first token, D the
        # rest. When the limit is maxIterTimes (max_tokens absent or not smaller), D still runs
        # maxIterTimes steps, so the total is maxIterTimes + 1; a smaller max_tokens is exact.
        limit = self.max_output_tokens(max_tokens)
        return limit + 1 if limit == self.max_iter_times else limit

    def pd_decode_tokens(self, max_tokens: int | None) -> int:
        return self.pd_total_tokens(max_tokens) - 1  # tokens D generates after P's first


def token_ids_prompt(limits: TokenLimits, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
    """A prompt the client gave as token ids (`req.kind == "token_ids"`), checked: every id in
    the vocabulary, the length rule (cut to its last tokens under truncation). Needs no
    tokenizer, only the model's limits: the tokenizer pool runs it, and so does the ingress
    itself once it has a model's limits (`ingress/backend.py`), without a round trip."""
    if not isinstance(req.token_ids, list):
        return Rejection(req.param, f"{req.param} must be a list of token ids")
    try:
        kept = limits.for_request(req.truncate).check_token_ids(req.token_ids, req.param)
    except TokenLimitError as exc:
        return exc.rejection()
    return TokenizedPrompt(kept, len(kept), truncated=len(kept) < len(req.token_ids))
