"""What a request asks its output to be, as a small picklable value: `JsonConstraint`.

The protocol layer builds one from OpenAI's `response_format` (`from_response_format`) and puts
it in `SamplingParams.constraint`; it travels through Ray handles and the engine process's pipe
as two strings, and only the engine, when a sequence first samples, turns it into a grammar
state (`start`). Building one checks the schema (about a millisecond, no tokenizer), so a bad
schema is refused with a message naming it before any model work. The first check in a process
imports xgrammar (~1 s).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_app.engine.constraint import ConstraintContext
    from serve_app.structured.json_state import JsonState

KINDS = ("json_object", "json_schema")


class ResponseFormatError(ValueError):
    """A response format that cannot be served; `param` is the field to name in a 400."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)  # no slots: frozen slotted dataclasses pickle only from 3.11
class JsonConstraint:
    """Output that is one JSON object (`json_object`) or one JSON value valid against a schema
    (`json_schema`), without free whitespace, completed within the request's max_tokens."""

    kind: str  # one of KINDS
    schema_json: str = ""  # json_schema: the schema as compact JSON, its key order kept

    def start(self, ctx: ConstraintContext) -> JsonState:
        """A fresh grammar state for one sequence (runs in the engine)."""
        from serve_app.structured import grammars
        from serve_app.structured.closing import ClosingPolicy
        from serve_app.structured.json_state import JsonState

        vocab = grammars.vocabulary(ctx.model_path, ctx.vocab_size)
        grammar = grammars.compiled(ctx.model_path, ctx.vocab_size, self.kind, self.schema_json)
        return JsonState(grammar, ClosingPolicy(vocab), ctx)


def json_object() -> JsonConstraint:
    return JsonConstraint("json_object")


def json_schema(schema: Mapping[str, Any] | str | bool) -> JsonConstraint:
    """A schema's constraint; ValueError, with the reason, for a schema xgrammar cannot use."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise ValueError(f"must be a JSON object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot be written as JSON: {exc}") from None
    from serve_app.structured.grammars import schema_problem

    problem = schema_problem(text)
    if problem:
        raise ValueError(f"is not a usable JSON schema: {problem}")
    return JsonConstraint("json_schema", text)


def from_response_format(
    response_format: Mapping[str, Any] | None, param: str = "response_format"
) -> JsonConstraint | None:
    """OpenAI's `response_format` (a plain dict: `{"type": "text"}`, `{"type": "json_object"}`
    or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) as a constraint,
    None for text. ResponseFormatError names the field at fault.

    `strict` is accepted either way and changes nothing: every schema is enforced as OpenAI's
    strict mode does (no property the schema does not name).
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_object()
    if kind != "json_schema":
        raise ResponseFormatError(
            f"{param}.type", f"must be text, json_object or json_schema, got {kind!r}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ResponseFormatError(f"{param}.json_schema", "is required with type json_schema")
    if spec.get("schema") is None:
        raise ResponseFormatError(f"{param}.json_schema.schema", "is required")
    try:
        return json_schema(spec["schema"])
    except ValueError as exc:
        raise ResponseFormatError(f"{param}.json_schema.schema", str(exc)) from None


def min_output_tokens(
    constraint: JsonConstraint, model_path: str | Path, vocab_size: int | None = None
) -> int:
    """Output tokens the constraint needs at least for a complete output with this model's
    tokenizer (0: no promise can be made): a request with a smaller max_tokens gets a cut
    output, so a caller can refuse it first. The engine refuses it too (RequestRejected).
    vocab_size: the logits' width; default: config.json's vocab_size. Loads the tokenizer the
    first time, far slower than any later call (docs/performance.md, "Grammars and their
    caches")."""
    from serve_app.engine.constraint import ConstraintContext

    if vocab_size is None:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        vocab_size = int(config["vocab_size"])
    ctx = ConstraintContext(str(model_path), vocab_size, ())
    return constraint.start(ctx).min_output_tokens
