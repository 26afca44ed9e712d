"""Range validators whose messages name the allowed range exactly as the seeds write it.

`Range(0.0, 2.0, low_open=True)` inside `Annotated[float | None, ...]` refuses 0 with
"must be in (0.0, 2.0]"; the ingress's error renderer prefixes the parameter name and appends
the value ("temperature must be in (0.0, 2.0], got 0.0"). Request models use `STRICT` so that a
string is never silently taken for a number or a boolean.
"""

from __future__ import annotations

import math

from pydantic import AfterValidator, ConfigDict

# Unknown fields are ignored (as vLLM and MindIE do); types are strict: "0.5" is not a float,
# "true" is not a bool, 1.5 and true are not ints. Ints are accepted for floats.
STRICT = ConfigDict(extra="ignore", strict=True)

UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1


def describe_range(
    low: float | None,
    high: float | None,
    low_open: bool = False,
    high_open: bool = False,
    also: tuple = (),
) -> str:
    if low is not None and high is not None:
        text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        text = f"{'>' if low_open else '>='} {low}"
    elif high is not None:
        text = f"{'<' if high_open else '<='} {high}"
    else:
        text = "a finite number"
    if also:
        text = " or ".join(str(v) for v in also) + f" or {text}"
    return f"must be {text}"


def Range(  # noqa: N802 - reads as a type annotation
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    also: tuple = (),
) -> AfterValidator:
    """A validator for Annotated[...]: None passes (the field is optional), NaN never does."""
    message = describe_range(low, high, low_open, high_open, also)

    def check(value):
        if value is None or value in also:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(message)
        if low is not None and (value <= low if low_open else value < low):
            raise ValueError(message)
        if high is not None and (value >= high if high_open else value > high):
            raise ValueError(message)
        return value

    return AfterValidator(check)
