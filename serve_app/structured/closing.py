"""The closing policy: one fixed, deterministic way to finish a partial output, and its length.

A grammar alone keeps an output valid but not finished: a random model at temperature 1 never
closes a string. So a sequence near the end of its budget asks how many tokens this policy
needs from where it stands, and hands over to it in time (json_state.py). The policy, at each
token:

1. the text the grammar makes certain from here (xgrammar's jump-forward string: a required
   key, `": "`, the rest of `true`), as the longest vocabulary token it starts with;
2. else the longest allowed token that starts the text closing what is open (`"` for an open
   string, then `}` / `]` for each open bracket, innermost first; json_lexer.py): it ends
   strings, optional parts, objects and arrays;
3. else `0` where a value starts (a number, ended at once);
4. else, inside a string, the allowed printable ASCII character that comes next after the
   text's last byte (wrapping around): the first letter of an enum value, fillers toward a
   minLength, and, as the bytes cycle, whatever character a pattern or format (`@` in an
   email) needs next, where always taking the same one would loop forever;
5. else the allowed token with the lowest id (in a byte-level vocabulary, one character: the
   first of `false` / `null`, a `,` toward required items or after a number).

Being a function of the matcher's state only, the same state always gets the same path, so a
path planned one step stays valid the next when its first token was taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from serve_app.structured.grammars import Vocabulary
from serve_app.structured.json_lexer import JsonLexer

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

_SPACE, _TILDE = ord(" "), ord("~")


class ClosingPolicy:
    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.zero = vocab.token_of.get(b"0")

    def next_token(
        self, matcher: xgr.GrammarMatcher, lexer: JsonLexer, bitmask: torch.Tensor
    ) -> int | None:
        """The policy's token in the matcher's state (None: nothing allowed); the matcher and
        the lexer stay as they were, bitmask is scribbled on."""
        return self._advance(matcher.fork(), lexer.copy(), bitmask)

    def path(
        self, matcher: xgr.GrammarMatcher, lexer: JsonLexer, bitmask: torch.Tensor, limit: int
    ) -> list[int] | None:
        """The policy's tokens from the matcher's state to a complete output ([] when it is
        complete), or None when that takes more than `limit` tokens (or never ends)."""
        if matcher.is_completed():
            return []
        sim, lexer, path = matcher.fork(), lexer.copy(), []
        while len(path) < limit:
            token = self._advance(sim, lexer, bitmask)
            if token is None:
                return None
            path.append(token)
            if sim.is_completed():
                return path
        return None

    def _advance(
        self, sim: xgr.GrammarMatcher, lexer: JsonLexer, bitmask: torch.Tensor
    ) -> int | None:
        """Take the policy's next token into `sim` and `lexer`. Candidates are tried by
        accepting them (a refusal is cheap and changes nothing), where the full mask walks the
        whole vocabulary: only the last resort needs it (docs/performance.md, "Masks and the
        closing policy")."""
        token = self._accept_longest(sim, sim.find_jump_forward_string().encode("utf-8"))
        if token is None:
            token = self._accept_longest(sim, lexer.closing_text())
        starts_value = not (lexer.in_string or lexer.in_number)
        if token is None and starts_value and self.zero is not None:
            token = self.zero if sim.accept_token(self.zero) else None
        if token is None:
            token = self._allowed_next(sim, lexer, bitmask)
            if token is None or not sim.accept_token(token):
                return None
        lexer.feed(self.vocab.token_bytes[token])
        return token

    def _accept_longest(self, sim: xgr.GrammarMatcher, text: bytes) -> int | None:
        """Accept the longest ordinary token that `text` starts with and the grammar allows."""
        token_of = self.vocab.token_of
        for size in range(min(len(text), self.vocab.longest), 0, -1):
            token = token_of.get(text[:size])
            if token is not None and sim.accept_token(token):
                return token
        return None

    def _allowed_next(
        self, sim: xgr.GrammarMatcher, lexer: JsonLexer, bitmask: torch.Tensor
    ) -> int | None:
        """Steps 4 and 5: the next byte in a string, else the lowest allowed id."""
        fill_mask(sim, bitmask, self.vocab)
        words = bitmask.numpy()[0]
        if lexer.in_string:
            byte_tokens, after = self.vocab.byte_tokens, max(lexer.last_byte + 1, _SPACE)
            for value in (*range(after, _TILDE + 1), *range(_SPACE, after)):  # printable ASCII
                token = byte_tokens[value]
                if token >= 0 and _allowed(words, token):
                    return token
        nonzero = np.flatnonzero(words)
        if not len(nonzero):
            return None
        word = int(words[nonzero[0]]) & 0xFFFFFFFF
        return int(nonzero[0]) * 32 + (word & -word).bit_length() - 1


def fill_mask(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, vocab: Vocabulary) -> None:
    """The grammar's mask of next tokens, less the tokens with control characters (xgrammar
    lets a string with minLength hold a raw tab, which strict JSON parsers refuse)."""
    matcher.fill_next_token_bitmask(bitmask)
    bitmask &= vocab.printable


def _allowed(words: np.ndarray, token: int) -> bool:
    """Whether the bitmask (int32 words, 32 tokens each) allows the token."""
    return bool(words[token >> 5] >> (token & 31) & 1)
