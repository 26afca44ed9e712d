"""Banned words (Triton's `bad_words`, as TensorRT-LLM clients send them): a constraint under
which the output never spells one of the words the way the model's tokenizer spells them.

Each word is tokenized twice, as given and with a leading space (how a word inside a sentence is
usually spelt by BPE tokenizers), without special tokens. A one-token spelling is never sampled;
for a longer one, its last token is barred whenever the output so far ends with the rest of it.
That is the rule of vLLM's and TensorRT-LLM's bad-words lists: the text can still contain the
word when the model reaches it through another split of tokens, which a token-level ban cannot
see. The words' token ids are worked out once per model and word list.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve_app.engine.constraint import ConstraintContext

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class BannedWords:
    """The picklable spec (`SamplingParams.constraint`): the words to keep out of the output."""

    words: tuple[str, ...]

    def start(self, ctx: ConstraintContext) -> BannedWordsState:
        return BannedWordsState(spellings(ctx.model_path, self.words))


class BannedWordsState:
    """One sequence's ban: stateless apart from the output it is shown each step."""

    min_output_tokens = 0

    def __init__(self, sequences: tuple[tuple[int, ...], ...]) -> None:
        import torch  # here, not at the top: the ingress builds the spec and must not load torch

        singles = sorted({s[0] for s in sequences if len(s) == 1})
        self._singles = torch.tensor(singles, dtype=torch.long)
        self._longer = [(s[:-1], s[-1]) for s in sequences if len(s) > 1]

    def mask(self, logits_row: torch.Tensor, output_ids: Sequence[int], remaining: int) -> None:
        if len(self._singles):
            logits_row[self._singles] = float("-inf")
        for prefix, last in self._longer:
            n = len(prefix)
            if len(output_ids) >= n and tuple(output_ids[-n:]) == prefix:
                logits_row[last] = float("-inf")


@functools.lru_cache(maxsize=64)
def spellings(model_path: str, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token-id sequences of every word, as given and with a leading space."""
    tokenizer = _tokenizer(model_path)
    found: set[tuple[int, ...]] = set()
    for word in words:
        for text in {word, word if word.startswith(" ") else " " + word}:
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found.add(ids)
    return tuple(sorted(found))


@functools.lru_cache(maxsize=8)
def _tokenizer(model_path: str):
    from serve_app.models.loader import load_tokenizer

    return load_tokenizer(model_path)
