"""The JSON of a stream event's payload, as UTF-8 bytes: compact, non-ASCII text kept as is.

Every streamed token is one event, so its encoding is on the serving path once per token per
stream. orjson encodes it in one call into native code, many times faster than the standard
library's encoder, whose per-call Python overhead outweighs a payload this small, and writes
bytes, which need no second encoding pass (docs/performance.md, "The serving path's own lines
and streams").
Its output is json's compact form, but for two things no client tells apart: floats in their
shortest round-trip form without a `+` or leading zero in the exponent (`1e-5` for json's
`1e-05`), and NaN or an infinity as `null` (json writes `NaN` / `-Infinity`, which is not JSON).
Keys that are not strings are written as strings, as json does.
"""

from __future__ import annotations

from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS


def compact_json(payload: Any) -> bytes:
    return orjson.dumps(payload, option=_OPTIONS)
