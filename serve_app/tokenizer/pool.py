"""TokenizerPool: text or chat messages -> prompt token ids, with the token-count rules applied.

Place in the request path: the ingress calls it before any replica work, so a too-long prompt is
refused (or cut, with truncation=true) on CPU. A plain class; the app builder makes it a Ray Serve
deployment with several CPU replicas. Errors come back as `Rejection` values, never exceptions,
so each API family renders them in its own envelope.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from serve_app.config import AppConfig
from serve_app.messages import ErrorKind, Rejection, TokenizedPrompt, TokenizeRequest, text_of
from serve_app.models.loader import load_tokenizer, resolve_model_path
from serve_app.placement import bind_process
from serve_app.tokenizer.limits import TokenLimitError, TokenLimits, token_ids_prompt
from serve_app.tokenizer.tools import with_tools


@dataclass(slots=True)
class _Model:
    tokenizer: Any
    limits: TokenLimits
    vocab_size: int | None
    max_position_embeddings: int | None
    # Fast tokenizers can fail with "Already borrowed" when one instance is used from several
    # threads at once; to_thread may run two requests of this replica concurrently.
    lock: threading.Lock = field(default_factory=threading.Lock)


class TokenizerPool:
    def __init__(self, config: AppConfig | None = None, off_engine_cores: bool = False) -> None:
        """config: the app's config, validated once by the builder (defaults when None).
        off_engine_cores: bind this process to the cores no engine process is bound to
        (ModelConfig engineCpus); the app builder asks for it, in-process users do not."""
        config = config or AppConfig()
        self._models: dict[str, _Model] = {}
        for model in config.BackendConfig.ModelDeployConfig.ModelConfig:
            path = resolve_model_path(model.modelWeightPath)
            hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            vocab_size = hf_config.get("vocab_size")
            max_pos = hf_config.get("max_position_embeddings")
            limits = TokenLimits.of(config, max_pos, vocab_size)
            self._models[model.modelName] = _Model(
                load_tokenizer(path), limits, vocab_size, max_pos
            )
        if off_engine_cores:  # loaded on every core (while the app starts), served on these
            bind_process(config.serving_cores())

    def model_names(self) -> list[str]:
        return list(self._models)

    def limits(self, model: str) -> TokenLimits:
        """The token-count rules of one model (KeyError if it is not served)."""
        return self._get(model).limits

    def model_info(self, model: str) -> dict:
        served = self._get(model)
        limits = served.limits
        return {
            "model": model,
            "vocab_size": served.vocab_size,
            "max_position_embeddings": served.max_position_embeddings,
            "max_seq_len": limits.max_seq_len,
            "max_input_token_len": limits.max_input_token_len,
            "max_iter_times": limits.max_iter_times,
            "truncation": limits.truncation,
            "completion_prompt_limit": limits.completion_prompt_limit,
            "chat_prompt_limit": limits.chat_prompt_limit,
            "eos_token_id": served.tokenizer.eos_token_id,
        }

    async def tokenize(self, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        served = self._models.get(req.model)
        if served is None:
            return Rejection(
                "model",
                f"model {req.model!r} is not served here; available: {', '.join(self._models)}",
                ErrorKind.NOT_FOUND,
            )
        return await asyncio.to_thread(self._tokenize, served, req)

    async def decode(
        self, model: str, token_ids: list[int], skip_special_tokens: bool = True
    ) -> str:
        served = self._get(model)

        def run() -> str:
            with served.lock:
                return served.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return await asyncio.to_thread(run)

    def _get(self, model: str) -> _Model:
        served = self._models.get(model)
        if served is None:
            raise KeyError(f"model {model!r} is not served here; available: {list(self._models)}")
        return served

    # -- the CPU part, on a worker thread ---------------------------------------------------

    def _tokenize(self, served: _Model, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
        try:
            with served.lock:
                return _tokenize(served, req)
        except TokenLimitError as exc:  # too long, empty, or an id outside the vocabulary
            return exc.rejection()
        except _Refused as exc:
            return exc.rejection


class _Refused(Exception):
    def __init__(self, param: str, message: str, kind: ErrorKind = ErrorKind.VALIDATION) -> None:
        super().__init__(message)
        self.rejection = Rejection(param, message, kind)


def _encode(tokenizer, text: str, param: str, add_special_tokens: bool) -> list[int]:
    # JSON can carry a lone UTF-16 surrogate ("\\ud83d"), which is no text the tokenizer can
    # encode: that is bad input (a 4xx naming the field), not a server error.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Refused(
            param,
            f"{param} is not valid Unicode text (character {exc.start} is a lone surrogate)",
        ) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _tokenize(served: _Model, req: TokenizeRequest) -> TokenizedPrompt | Rejection:
    """req.counting: /detokenize for token ids; else /tokenize, the ids as the model would see
    them, whatever their count (as vLLM's /tokenize, no length rule applies), and each id's
    string."""
    if not req.counting:
        return _prompt(served, req, served.limits.for_request(req.truncate))
    if req.kind == "token_ids":
        return _detokenize(served, req)
    prompt = _prompt(served, req, _Uncounted())
    prompt.token_strs = served.tokenizer.convert_ids_to_tokens(prompt.prompt_token_ids)
    return prompt


def _prompt(served: _Model, req: TokenizeRequest, limits) -> TokenizedPrompt | Rejection:
    tokenizer = served.tokenizer
    if req.kind == "templated" and getattr(tokenizer, "chat_template", None):
        if not isinstance(req.text, str):
            raise _Refused(req.param, f"{req.param} must be a string")
        text = _render(tokenizer, [{"role": "user", "content": req.text}], req.param)
        ids = _encode(tokenizer, text, req.param, False)
        kept = limits.check_completion_prompt(ids, req.param)
        return TokenizedPrompt(kept, len(kept), truncated=len(kept) < len(ids), prompt_text=text)
    if req.kind in ("completion", "text", "templated"):
        if not isinstance(req.text, str):
            raise _Refused(req.param, f"{req.param} must be a string")
        ids = _encode(tokenizer, req.text, req.param, req.add_special_tokens)
        kept = limits.check_completion_prompt(ids, req.param)
        return TokenizedPrompt(kept, len(kept), truncated=len(kept) < len(ids))
    if req.kind == "chat":
        param = "messages" if req.param == "prompt" else req.param
        messages, extra = with_tools(tokenizer, _chat_messages(req.messages, param), req.tools)
        text = _render(tokenizer, messages, param, req.add_generation_prompt, **extra)
        ids = _encode(tokenizer, text, param, req.add_special_tokens and req.counting)
        kept = limits.check_chat_prompt(ids, param)
        return TokenizedPrompt(kept, len(kept), truncated=len(kept) < len(ids), prompt_text=text)
    if req.kind == "token_ids":
        return token_ids_prompt(limits, req)
    raise _Refused("kind", f"unknown tokenize kind {req.kind!r}", ErrorKind.UNSUPPORTED)


def _detokenize(served: _Model, req: TokenizeRequest) -> TokenizedPrompt:
    """/detokenize: ids in the vocabulary back to their text, special tokens kept (as vLLM)."""
    ids, high = req.token_ids, (served.vocab_size or len(served.tokenizer)) - 1
    for i, token in enumerate(ids or ()):
        if not 0 <= token <= high:
            raise _Refused(
                f"{req.param}[{i}]", f"{req.param}[{i}] must be in [0, {high}], got {token}"
            )
    text = served.tokenizer.decode(ids, skip_special_tokens=False)
    return TokenizedPrompt(list(ids), len(ids), prompt_text=text)


class _Uncounted:
    """/tokenize's limits: none (the prompt's ids as they are)."""

    def check_completion_prompt(self, ids, param):
        return list(ids)

    check_chat_prompt = check_completion_prompt


def _render(tokenizer, messages: list[dict], param: str, generation: bool = True, **extra) -> str:
    """The chat template's text for these messages, ready for the assistant's turn unless
    `generation` is False."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False, **extra
        )
    except Exception as exc:  # jinja errors, raise_exception() in templates, no template
        message = f"{param} could not be rendered by the chat template: {exc}"
        raise _Refused(param, message) from exc


def _chat_messages(messages: Any, param: str) -> list[dict]:
    """Messages for the template: text parts joined into one string, other keys kept.

    Many model templates (Qwen2.5's among them) only render string content, so text parts are
    joined here (`messages.text_of`), and every template sees plain strings.
    """
    if not isinstance(messages, list) or not messages:
        raise _Refused(param, f"{param} must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Refused(f"{param}[{i}]", f"{param}[{i}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"{param}[{i}].content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    message = f"{where}: only text parts are supported, got {kind!r}"
                    raise _Refused(where, message, ErrorKind.UNSUPPORTED)
                if not isinstance(part.get("text"), str):
                    raise _Refused(where, f"{where}.text must be a string")
            message = {**message, "content": text_of(content)}
        elif content is not None and not isinstance(content, str):
            raise _Refused(
                f"{param}[{i}].content",
                f"{param}[{i}].content must be a string or a list of text parts",
            )
        out.append(message)
    return out
