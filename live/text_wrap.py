"""Text for a terminal cell: wrapped at word boundaries, never inside a word, key, id or
number (fold), and elided with MARK where it cannot fit (cut, elide); widths in terminal
cells (wide East Asian characters take two, combining marks none). live/table.py lays out
the columns; this module cuts their text."""

from __future__ import annotations

import re
import unicodedata

MARK = "\u2026"   # "…": the cut mark
ELIDE_LINES = 2    # a document value is cut after this many lines (elide)


def char_width(ch: str) -> int:
    """The cells one character takes on a terminal."""
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def width(s: str) -> int:
    """The cells `s` takes on a terminal."""
    if s.isascii():
        return len(s)
    return sum(map(char_width, s))


def cut(s: str, w: int) -> str:
    """`s` elided to `w` cells: its head and MARK (s itself when it fits)."""
    if width(s) <= w:
        return s
    if s.isascii():
        return s[:max(0, w - 1)].rstrip() + MARK
    out, n = [], 0
    for ch in s:
        cw = char_width(ch)
        if n + cw > w - 1:
            break
        out.append(ch)
        n += cw
    return "".join(out).rstrip() + MARK


# where a line may break: at a space (dropped), after a comma (kept: JSON lists and objects)
_PIECE = re.compile(r"[^,]*,|[^,]+")
_BREAKS = re.compile(r" |(?<=,)")   # the same pieces in one split (C speed)


def words(s: str) -> list[str]:
    """The unbreakable pieces of `s`: the words between spaces, and within a word the parts
    that end with a comma (JSON breaks after its commas, never inside a string or number)."""
    return [p for w in s.split(" ") for p in _PIECE.findall(w)]


def longest_word(s: str) -> int:
    """The width of the widest unbreakable piece of `s` (words())."""
    if " " not in s and "," not in s:
        return width(s)
    return max(map(len if s.isascii() else width, _BREAKS.split(s)), default=0)


def fold(s: str, w: int) -> list[str]:
    """`s` wrapped to lines of at most `w` cells at word boundaries (words()): a word, key,
    id or number is never split over two lines; one wider than `w` alone is elided (MARK)."""
    wf = len if s.isascii() else width
    if wf(s) <= w:
        return [s]
    lines: list[str] = []
    cur, n = "", 0
    for word in s.split(" "):
        pieces = _PIECE.findall(word) or [""]
        for k, piece in enumerate(pieces):
            sep = " " if k == 0 and n else ""
            pw = wf(piece)
            if n + len(sep) + pw <= w:
                cur += sep + piece
                n += len(sep) + pw
                continue
            if n:
                lines.append(cur)
            cur, n = (piece, pw) if pw <= w else ("", 0)
            if pw > w:
                lines.append(cut(piece, w))
    if n or not lines:
        lines.append(cur)
    return lines


def elide(s: str, w: int) -> list[str]:
    """`s` wrapped to `w` cells (_fold) and cut after ELIDE_LINES lines, the last ending in MARK."""
    lines = fold(s, w)
    if len(lines) <= ELIDE_LINES:
        return lines
    last = lines[ELIDE_LINES - 1]
    return lines[:ELIDE_LINES - 1] + [last if last.endswith(MARK) else cut(last + MARK, w)]
