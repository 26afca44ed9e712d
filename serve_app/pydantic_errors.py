"""pydantic's error locations and messages in our words, for config errors and request errors.

Both the config loader (`config/loading.py`) and the API families' error renderer
(`protocol/errors.py`) name the field at fault by its dotted path (`BackendConfig.ModelDeployConfig
.maxSeqLen`, `messages[0].content`) and state the rule with signs rather than pydantic's words
("must be >= 1" rather than "Input should be greater than or equal to 1").
"""

from __future__ import annotations

from collections.abc import Iterable

_REWORDINGS = (
    ("greater than or equal to", ">="),
    ("less than or equal to", "<="),
    ("greater than", ">"),
    ("less than", "<"),
    ("Input should be", "must be"),
    ("Value should", "must"),
    ("Tuple should", "must"),
    (" after validation", ""),
)


def dotted(loc: Iterable[object]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        text = str(part)
        if isinstance(part, int) or text.isdigit():
            out += f"[{text}]"
        else:
            out += f".{text}" if out else text
    return out


def reword(message: str) -> str:
    """pydantic's message with our own validators' prefix dropped and comparisons as signs."""
    message = message.removeprefix("Value error, ")
    for words, sign in _REWORDINGS:
        message = message.replace(words, sign)
    return message
