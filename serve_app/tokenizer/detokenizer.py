"""Incremental, UTF-8-safe detokenization of a stream of generated token ids.

Byte-level BPE (Qwen2) splits Chinese characters and emoji across tokens, and some tokenizers
only render a leading space in context, so decoding tokens one at a time is wrong. We decode a
small sliding window instead (vLLM's prefix/read offsets): ``ids[prefix:read]`` is text already
emitted, kept as context; ``ids[prefix:]`` adds the pending tokens; the difference is the delta.
Each step costs O(window), never O(output length). With a Rust tokenizer that decodes the same
text, `tokenizers`' own `DecodeStream` runs that window in Rust (the same rule, one call a token
instead of two decodes and the slicing between them); should it refuse a window, the Python
path goes on from the same place.
"""

from __future__ import annotations

from typing import Any

# Decoders replace incomplete UTF-8 with U+FFFD; a tail ending in it may complete with more tokens.
_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the first output token (leading-space rules need a left side).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded output."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = _rust_backend(tokenizer)
        self._decode_ids = tokenizer.decode if self._backend is None else self._backend.decode
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT:]
        # A prompt that ends mid-character would make the first delta start with a split
        # character's U+FFFD accounting; such context is worth less than exact output text.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context  # window context + all output ids
        self._n_context = len(context)
        self._prefix = 0  # start of the decode window (already-emitted context)
        self._read = len(context)  # ids before this are emitted as text
        self._text = ""
        self._stream = _decode_stream(self._backend, context, skip_special_tokens)

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until released)."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """All output token ids pushed so far (no prompt context)."""
        return self._ids[self._n_context :]

    @property
    def has_pending(self) -> bool:
        """Some pushed tokens are held back (an incomplete character): their text is not out."""
        return self._read < len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self._skip)

    def push_one(self, token_id: int) -> str:
        """Adds one token and returns its text delta ("" while a character is incomplete)."""
        self._ids.append(token_id)
        if self._stream is None:
            return self._advance(final=False)
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception:  # a window whose text does not extend the emitted text's
            self._stream = None
            return self._advance(final=False)
        return "" if delta is None else self._emitted(delta)  # None: held back, as _advance would

    def push(self, new_token_ids: list[int]) -> str:
        """Adds several tokens (one engine step) and returns their combined text delta."""
        if not new_token_ids:
            return ""
        if self._stream is not None:
            return "".join([self.push_one(token_id) for token_id in new_token_ids])
        self._ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emits whatever is still held back, even an incomplete character (as U+FFFD)."""
        self._stream = None  # the window's state is ours too: the Python path ends it
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        # Hold back when nothing new is visible yet (e.g. a skipped special token) or when the
        # tail may be the first bytes of a multi-byte character.
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""
        return self._emitted(new_text[len(prefix_text) :])

    def _emitted(self, delta: str) -> str:
        """`delta` is out: the emitted tokens become the next window's context (older ones are
        never decoded again), on either path, so that the Python path can take over anywhere."""
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta


def _rust_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer under a fast tokenizer whose `decode` is the library's and cleans up
    no spaces (its own `decode` then returns the same text and skips the wrapper's argument
    handling, which costs several times the decode itself: docs/performance.md,
    "Detokenizing"), else None (the tokenizer's `decode` is used)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4 names the class differently: no shortcut there
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and type(tokenizer).decode is TokenizersBackend.decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        and backend is not None
    ):
        return backend
    return None


def _decode_stream(backend: Any, context: list[int], skip_special_tokens: bool) -> Any:
    """`tokenizers`' DecodeStream over the Rust tokenizer, `context` as its emitted window; None
    without a Rust tokenizer or where the library has none that takes a context (one call into
    Rust a token, where the Python path makes two decodes and slices between them:
    docs/performance.md, "Detokenizing")."""
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None
