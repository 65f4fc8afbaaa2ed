"""Text that came from the other side (server names, ERROR lines, mechanism lists, keys,
stream names), made safe before it reaches a terminal or stderr: the one escaping of the
project. Protocol errors use it in their messages; the CLI uses it in tables and error lines."""

from __future__ import annotations

import re
from collections.abc import Iterable

# C0/C1 controls, DEL, and the Unicode format characters that reorder or hide text
# (bidi overrides and isolates, zero-width marks, line/paragraph separators, BOM).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                          "\u2060-\u206f\ufeff\ufff9-\ufffb]")


def _escape_char(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: object) -> str:
    """Text that came from the other side, made safe for a terminal: control characters
    (ESC included) become `\\x1b`-style escapes; printable text is returned unchanged."""
    if type(text) is not str:
        text = str(text)
    if text.isascii() and text.isprintable():
        return text
    return _UNPRINTABLE.sub(_escape_char, text)


def ranges_text(vbs: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out = []
    ordered = sorted(vbs)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
