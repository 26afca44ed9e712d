"""xgrammar's view of a model's vocabulary and the grammars compiled against it, cached for the
whole process.

Building a vocabulary's `TokenizerInfo` walks the whole vocabulary and compiling a schema builds
its token masks, each costing far more than a sequence's step, while a request may start several
sequences (n > 1) and many requests share one schema: so both are built once per (model folder,
logits width) and per (that, kind, schema) (docs/performance.md, "Grammars and their caches").
Everything here runs where the engine runs (its thread or its child process), so xgrammar is
imported there, not where requests are parsed.

Every grammar is compiled without free whitespace (`any_whitespace=False`): a model may not pad
its output with spaces and newlines, which both wastes tokens and lets a random model wander.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any object, any properties
_CONTROL = re.compile(rb"[\x00-\x1f]")
_MAX_GRAMMARS = 256  # compiled grammars kept (a small schema's is small beside a model)
# xgrammar's compiler cache also keeps the sub-grammars schemas share (a string's token masks),
# so that a second schema reuses them instead of computing them again (docs/performance.md,
# "Grammars and their caches")
_COMPILER_CACHE_BYTES = 256 << 20


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A model's tokens as xgrammar and the closing policy see them."""

    info: xgr.TokenizerInfo
    compiler: xgr.GrammarCompiler
    token_bytes: list[bytes]  # by token id (xgrammar's decoded vocabulary)
    token_of: dict[bytes, int]  # ordinary tokens by their bytes (the lowest id of duplicates)
    longest: int  # bytes in the longest ordinary token
    printable: torch.Tensor  # bitmask (xgrammar's layout) of the tokens without control bytes
    byte_tokens: tuple[int, ...]  # the single-byte tokens, by byte value (-1: none)


@functools.lru_cache(maxsize=8)
def vocabulary(model_path: str, vocab_size: int) -> Vocabulary:
    """The vocabulary of the tokenizer in `model_path`, padded to `vocab_size` (the logits'
    width). Stop tokens are not fixed here: each matcher takes the engine's EOS ids."""
    import xgrammar as xgr

    from serve_app.models.loader import load_tokenizer

    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(model_path), vocab_size=vocab_size)
    token_bytes = info.decoded_vocab  # a property that rebuilds the whole list: read once
    special = set(info.special_token_ids)
    token_of: dict[bytes, int] = {}
    for token, data in enumerate(token_bytes):
        if data and token not in special:
            token_of.setdefault(data, token)
    printable = xgr.allocate_token_bitmask(1, vocab_size)
    words = printable.numpy().view(np.uint32)[0]  # the same memory, bits as unsigned
    for token, data in enumerate(token_bytes):
        if _CONTROL.search(data):
            words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
    compiler = xgr.GrammarCompiler(info, cache_limit_bytes=_COMPILER_CACHE_BYTES)
    longest = max(map(len, token_of))
    byte_tokens = tuple(token_of.get(bytes([value]), -1) for value in range(256))
    return Vocabulary(info, compiler, token_bytes, token_of, longest, printable, byte_tokens)


@functools.lru_cache(maxsize=_MAX_GRAMMARS)
def compiled(model_path: str, vocab_size: int, kind: str, schema_json: str) -> xgr.CompiledGrammar:
    """The grammar of a `JsonConstraint` (kind, schema_json) for one vocabulary."""
    compiler = vocabulary(model_path, vocab_size).compiler
    if kind == "json_object":
        return compiler.compile_json_schema(
            JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
        )
    # strict_mode: no property or item the schema does not name, as OpenAI's strict mode; the
    # output still validates against a schema that would allow more
    return compiler.compile_json_schema(schema_json, any_whitespace=False, strict_mode=True)


def schema_problem(schema_json: str) -> str | None:
    """Why xgrammar cannot turn this JSON schema into a grammar, or None when it can. Needs no
    tokenizer (about a millisecond), so it can answer before any model work."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, strict_mode=True)
    except RuntimeError as exc:  # xgrammar reports schema errors as RuntimeError
        return clean_message(str(exc))
    return None


_LOG_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")  # "[15:23:13] /project/cpp/x.cc:49: "
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def clean_message(message: str) -> str:
    """xgrammar's error text without its C++ log prefix and the echo of the whole schema."""
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", message.strip()))
    return message.split(" The JSON string is:", 1)[0].strip()
