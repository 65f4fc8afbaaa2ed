"""Splitting many received lines at once, shared by the client state machine and the
capture's batch builder so that each line is split only once on the hot path.

``split_lines`` splits every line into at most five words. Lines of the form
``RDATA <stream> <instance> <token|batch> <row>`` with a valid token are the fast path;
the indices of every other line (other commands, bad tokens, blank lines) are in ``slow``
and those lines' entries in ``parts`` are placeholders."""

from __future__ import annotations

import dataclasses
import operator

_first, _second, _third, _fourth, _fifth = (operator.itemgetter(i) for i in range(5))
_BLANK = [b"", None, None, b"batch", b""]


@dataclasses.dataclass(slots=True)
class SplitLines:
    lines: list[bytes]
    parts: list[list]
    slow: list[int]                 # sorted indices of lines not on the RDATA fast path
    tokens: list[int | None]        # RDATA token (None for batch and for slow lines)

    def streams(self) -> list:
        return list(map(_second, self.parts))

    def instances(self) -> list:
        return list(map(_third, self.parts))

    def rows(self) -> list:
        return list(map(_fifth, self.parts))


def split_lines(lines: list[bytes]) -> SplitLines:
    n = len(lines)
    parts = [line.split(b" ", 4) for line in lines]
    if list(map(len, parts)).count(5) == n and list(map(_first, parts)).count(b"RDATA") == n:
        slow: set[int] = set()
    else:
        slow = {i for i, p in enumerate(parts) if len(p) != 5 or p[0] != b"RDATA"}
        for i in slow:
            parts[i] = _BLANK
    toks = list(map(_fourth, parts))
    try:
        tokens = [None if t == b"batch" else int(t) for t in toks]
    except ValueError:
        tokens = []
        for i, t in enumerate(toks):
            if t == b"batch":
                tokens.append(None)
            elif t.isascii() and t.lstrip(b"-").isdigit():
                tokens.append(int(t))
            else:
                tokens.append(None)
                parts[i] = _BLANK
                slow.add(i)
    return SplitLines(lines, parts, sorted(slow), tokens)
