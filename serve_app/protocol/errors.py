"""Errors as values with a kind, rendered in each API family's envelope in one place.

A handler raises `APIError(kind, message, param)`; the ingress's exception handler picks the
family from the route (`family_for_path`) and renders status and body:

| kind         | MindIE (error, error_type)          | OpenAI {"error": {...}} | Triton {"error"} |
|--------------|-------------------------------------|-------------------------|------------------|
| validation   | 422 Input Validation Error          | 400 BadRequestError     | 400              |
| unsupported  | 422 Input Validation Error          | 400 BadRequestError     | 400              |
| not_found    | 404 NotFoundError                   | 404 NotFoundError       | 404              |
| rejected     | 424 Generation Error                | 400 BadRequestError     | 400              |
| engine       | 500 Incomplete Generation           | 500 InternalServerError | 500              |
| timeout      | 500 Incomplete Generation           | 500 InternalServerError | 500              |
| unavailable  | 503 Service Unavailable             | 503 ServiceUnavailable  | 503              |
| too_large    | 413 Payload Too Large               | 413 BadRequestError     | 413              |
"""

from __future__ import annotations

import re
from typing import Literal

Family = Literal["mindie", "openai", "triton"]
Kind = Literal[
    "validation", "unsupported", "not_found", "rejected", "engine", "timeout", "unavailable",
    "too_large",
]  # fmt: skip

_STATUS: dict[str, tuple[int, int, int]] = {  # kind -> (mindie, openai, triton)
    "validation": (422, 400, 400),
    "unsupported": (422, 400, 400),
    "not_found": (404, 404, 404),
    "rejected": (424, 400, 400),
    "engine": (500, 500, 500),
    "timeout": (500, 500, 500),
    "unavailable": (503, 503, 503),
    "too_large": (413, 413, 413),
}
_MINDIE_TYPE = {
    "validation": "Input Validation Error",
    "unsupported": "Input Validation Error",
    "not_found": "NotFoundError",
    "rejected": "Generation Error",
    "engine": "Incomplete Generation",
    "timeout": "Incomplete Generation",
    "unavailable": "Service Unavailable",
    "too_large": "Payload Too Large",
}
_OPENAI_TYPE = {
    "validation": "BadRequestError",
    "unsupported": "BadRequestError",
    "not_found": "NotFoundError",
    "rejected": "BadRequestError",
    "engine": "InternalServerError",
    "timeout": "InternalServerError",
    "unavailable": "ServiceUnavailableError",
    "too_large": "BadRequestError",
}


class APIError(Exception):
    """A request failed; `param` names the request field at fault (None when none is)."""

    def __init__(self, kind: Kind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    def status(self, family: Family) -> int:
        mindie, openai, triton = _STATUS[self.kind]
        return {"mindie": mindie, "openai": openai, "triton": triton}[family]

    def body(self, family: Family) -> dict:
        if family == "mindie":
            return {"error": self.message, "error_type": _MINDIE_TYPE[self.kind]}
        if family == "openai":
            return {
                "error": {
                    "message": self.message,
                    "type": _OPENAI_TYPE[self.kind],
                    "param": self.param,
                    "code": self.status("openai"),
                }
            }
        return {"error": self.message}


def family_for_path(path: str) -> Family:
    """Which envelope a route's errors use: /v1/* OpenAI, /v2/* Triton, the rest MindIE."""
    if path.startswith("/v1/"):
        return "openai"
    # stopInfer and the readiness routes are MindIE management routes under /v2 (MINDIE.md)
    if path.startswith("/v2/") and path.endswith(("/generate", "/generate_stream")):
        return "triton"
    return "mindie"


_REJECTION_KIND = {
    "validation": "validation",
    "too_long": "validation",
    "unknown_model": "not_found",
    "engine": "rejected",
    "unsupported": "unsupported",
}


def from_rejection(rejection) -> APIError:
    """A `messages.Rejection` from the tokenizer pool as an APIError."""
    return APIError(_REJECTION_KIND[rejection.kind], rejection.message, rejection.param)


def from_validation_errors(errors: list[dict], prefix_skip: tuple = ("body",)) -> APIError:
    """pydantic / FastAPI validation errors -> one APIError naming the first bad parameter."""
    by_param: dict[str, list[str]] = {}
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p not in prefix_skip]
        if error.get("type") == "json_invalid":
            loc = []  # its location is a character offset, not a field
        name = _dotted([p for p in loc if not _UNION_TAG.match(p)]) or "body"
        # the branches of a union (str | list[str]) fail one by one: one line per parameter
        reason = _describe(name, error).removeprefix(name + " ")
        if reason not in by_param.setdefault(name, []):
            by_param[name].append(reason)
    lines = [f"{name} {_join(reasons)}" for name, reasons in by_param.items()]
    return APIError("validation", "; ".join(lines), next(iter(by_param), None))


def _join(reasons: list[str]) -> str:
    """'must be a valid string, got 5' + 'must be a valid list, got 5' -> one ', got 5'."""
    tails = {r.rpartition(", got ")[2] for r in reasons}
    if len(reasons) > 1 and len(tails) == 1 and all(", got " in r for r in reasons):
        return " or ".join(r.rpartition(", got ")[0] for r in reasons) + f", got {tails.pop()}"
    return " or ".join(reasons)


# pydantic names union branches in an error's location ("str", "list[str]",
# "function-after[check(), float]"): they are not request fields.
_UNION_TAG = re.compile(r"^([a-z-]+\[.*\]|str|int|float|bool|list|dict|none|constrained-str)$")


def _dotted(parts: list[str]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


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
    for words, sign in (
        ("greater than or equal to", ">="),
        ("less than or equal to", "<="),
        ("greater than", ">"),
        ("less than", "<"),
    ):
        msg = msg.replace(words, sign)
    msg = msg.replace("Input should be", "must be").replace("Value should", "must")
    return f"{name} {msg[0].lower() + msg[1:] if msg else msg}, got {_show(got)}"


def _show(value) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."
