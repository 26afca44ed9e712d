"""Where a partial JSON text stands: inside a string or a number or neither, and which brackets
are open.

The grammar matcher knows this but does not say it, and the closing policy needs it: the same
`}` token closes an object outside a string and is mere content inside one. The text a state
sees is always a valid JSON prefix (the grammar made it), so this small lexer is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = {ord("{"): "}", ord("["): "]"}
_CLOSE = (ord("}"), ord("]"))
_NUMBER = frozenset(b"-+.0123456789eE")


@dataclass(slots=True)
class JsonLexer:
    in_string: bool = False
    escaped: bool = False  # the previous character was the backslash of an escape
    in_number: bool = False  # the text ends with a number (which more digits would continue)
    last_byte: int = -1  # the text's last byte (-1: none yet)
    closers: str = ""  # what closes each open bracket, outermost first

    def feed(self, data: bytes) -> None:
        for byte in data:
            self.in_number = not self.in_string and byte in _NUMBER
            self.last_byte = byte
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == _BACKSLASH:
                    self.escaped = True
                elif byte == _QUOTE:
                    self.in_string = False
            elif byte == _QUOTE:
                self.in_string = True
            elif byte in _OPEN:
                self.closers += _OPEN[byte]
            elif byte in _CLOSE:
                self.closers = self.closers[:-1]

    def copy(self) -> JsonLexer:
        return JsonLexer(self.in_string, self.escaped, self.in_number, self.last_byte, self.closers)

    def closing_text(self) -> bytes:
        """The text that would close everything open, innermost first (empty in the middle of
        an escape, which no closing character ends)."""
        if self.escaped:
            return b""
        return (b'"' if self.in_string else b"") + self.closers[::-1].encode()
