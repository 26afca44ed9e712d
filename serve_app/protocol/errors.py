"""Errors as values with an `ErrorKind`, rendered in each API family's envelope in one place.

A failure is known somewhere (a pydantic range, a family's cross-rule, the tokenizer pool, the
engine, a timer) and travels as a kind plus a message naming the parameter: as `APIError` inside
the ingress, as `messages.Rejection` / `ReplicaChunk.error_kind` across handles. The ingress's
exception handler picks the family from the route (`family_for_path`) and `APIError.status` /
`APIError.body` render it; the table is `_ENVELOPES` below (docs/apis.md#errors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from serve_app.messages import ErrorKind, Rejection
from serve_app.pydantic_errors import dotted, reword

Family = Literal["mindie", "openai", "triton", "databricks"]
K = ErrorKind


@dataclass(frozen=True, slots=True)
class _Envelope:
    mindie: tuple[int, str]  # status, error_type
    openai: tuple[int, str]  # status, error.type
    triton: int  # status
    databricks: tuple[int, str]  # status, error_code (the SDK maps both onto its exceptions)


_ENVELOPES: dict[ErrorKind, _Envelope] = {
    K.VALIDATION: _Envelope(
        (422, "Input Validation Error"), (400, "BadRequestError"), 400, (400, "BAD_REQUEST")
    ),
    K.UNSUPPORTED: _Envelope(
        (422, "Input Validation Error"), (400, "BadRequestError"), 400, (400, "BAD_REQUEST")
    ),
    K.NOT_FOUND: _Envelope(
        (404, "NotFoundError"), (404, "NotFoundError"), 404, (404, "RESOURCE_DOES_NOT_EXIST")
    ),
    K.REJECTED: _Envelope(
        (424, "Generation Error"), (400, "BadRequestError"), 400, (400, "BAD_REQUEST")
    ),
    K.ENGINE: _Envelope(
        (500, "Incomplete Generation"), (500, "InternalServerError"), 500, (500, "INTERNAL_ERROR")
    ),
    K.TIMEOUT: _Envelope(
        (500, "Incomplete Generation"),
        (500, "InternalServerError"),
        500,
        (504, "DEADLINE_EXCEEDED"),
    ),
    K.UNAVAILABLE: _Envelope(
        (503, "Service Unavailable"),
        (503, "ServiceUnavailableError"),
        503,
        (503, "TEMPORARILY_UNAVAILABLE"),
    ),
    K.TOO_LARGE: _Envelope(
        (413, "Payload Too Large"), (413, "BadRequestError"), 413, (413, "BAD_REQUEST")
    ),
    K.UNAUTHORIZED: _Envelope(
        (401, "Unauthorized"), (401, "AuthenticationError"), 401, (401, "UNAUTHENTICATED")
    ),
    # Databricks answers over-limit requests with 429, which its SDK retries after Retry-After
    K.OVERLOADED: _Envelope(
        (503, "Service Unavailable"),
        (503, "ServiceUnavailableError"),
        503,
        (429, "REQUEST_LIMIT_EXCEEDED"),
    ),
}
# MindIE words a timeout that fails the request before its response starts as an engine callback
# timeout, whoever noticed it; a stream that already answered 200 reports it in the replica's
# own words.
_MINDIE_TIMEOUT = "Engine callback timeout"


class APIError(Exception):
    """A request failed; `param` names the request field at fault (None when none is)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.param = param
        # the replica's last chunk when it carried the failure: what was generated in it (a
        # caller that returns what it has on a timeout keeps it)
        self.partial = None

    @classmethod
    def of(cls, rejection: Rejection) -> APIError:
        """A refusal that crossed a handle as a value (from the tokenizer pool)."""
        return cls(rejection.kind, rejection.message, rejection.param)

    def status(self, family: Family) -> int:
        envelope = _ENVELOPES[self.kind]
        if family == "triton":
            return envelope.triton
        if family == "databricks":
            return envelope.databricks[0]
        return (envelope.mindie if family == "mindie" else envelope.openai)[0]

    def body(self, family: Family, in_stream: bool = False) -> dict:
        """The family's error body; in_stream: the last event of a stream after its 200."""
        envelope = _ENVELOPES[self.kind]
        if family == "mindie":
            message = self.message
            timeout = self.kind == K.TIMEOUT and not in_stream
            if timeout and not message.startswith(_MINDIE_TIMEOUT):
                message = f"{_MINDIE_TIMEOUT}: {message}"
            return {"error": message, "error_type": envelope.mindie[1]}
        if family == "openai":
            status, kind = envelope.openai
            error = {"message": self.message, "type": kind, "param": self.param, "code": status}
            return {"error": error}
        if family == "databricks":
            return {"error_code": envelope.databricks[1], "message": self.message}
        return {"error": self.message}


def invalid(param: str, rule: str) -> APIError:
    """A cross-rule broken: "<param> <rule>" naming the parameter."""
    return APIError(K.VALIDATION, f"{param} {rule}", param)


def family_for_path(path: str) -> Family:
    """Which envelope a route's errors use: /v1/* and the OpenAI-compatible paths under
    /serving-endpoints/ OpenAI; /serving-endpoints/{name}/invocations and /api/2.0/* Databricks;
    /v2/* Triton; the rest MindIE."""
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):  # vLLM's, OpenAI-shaped
        return "openai"
    if path.startswith("/api/2.0/") or path.startswith("/.well-known/"):
        return "databricks"
    if path.startswith("/serving-endpoints/"):
        return "databricks" if path.rstrip("/").endswith("/invocations") else "openai"
    # stopInfer and the readiness routes are MindIE management routes under /v2
    if path.startswith("/v2/") and path.endswith(("/generate", "/generate_stream")):
        return "triton"
    return "mindie"


def from_validation_errors(errors: list[dict], prefix_skip: tuple = ("body",)) -> APIError:
    """pydantic / FastAPI validation errors -> one APIError naming the first bad parameter."""
    by_param: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p not in prefix_skip]
        if error.get("type") == "json_invalid":
            loc = []  # its location is a character offset, not a field
        name = dotted([p for p in loc if not _UNION_TAG.match(p)]) or "body"
        # the branches of a union (str | list[str]) fail one by one: one line per parameter
        reason = _describe(name, error).removeprefix(name + " ")
        if reason not in by_param.setdefault(name, []):
            by_param[name].append(reason)
    lines = [f"{name} {_join(reasons)}" for name, reasons in by_param.items()]
    return APIError(K.VALIDATION, "; ".join(lines), next(iter(by_param), None))


def _join(reasons: list[str]) -> str:
    """'must be a valid string, got 5' + 'must be a valid list, got 5' -> one ', got 5'."""
    tails = {r.rpartition(", got ")[2] for r in reasons}
    if len(reasons) > 1 and len(tails) == 1 and all(", got " in r for r in reasons):
        return " or ".join(r.rpartition(", got ")[0] for r in reasons) + f", got {tails.pop()}"
    return " or ".join(reasons)


# pydantic names union branches in an error's location ("str", "list[str]",
# "function-after[check(), float]"): they are not request fields.
_UNION_TAG = re.compile(r"^([a-z-]+\[.*\]|str|int|float|bool|list|dict|none|constrained-str)$")


def _describe(name: str, error: dict) -> str:
    kind, ctx, got = error.get("type", ""), error.get("ctx") or {}, error.get("input")
    msg = str(error.get("msg", "is invalid"))
    if kind == "missing":
        return f"{name} is required"
    if kind == "json_invalid":
        return f"body is not valid JSON: {ctx.get('error', msg)}"
    if kind in ("model_type", "model_attributes_type", "dict_type") and name == "body":
        return "body must be a JSON object"
    if kind == "value_error":  # our range validators: "must be in (0.0, 2.0]"
        return f"{name} {msg.removeprefix('Value error, ')}, got {_show(got)}"
    msg = reword(msg)
    return f"{name} {msg[0].lower() + msg[1:] if msg else msg}, got {_show(got)}"


def _show(value) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."
