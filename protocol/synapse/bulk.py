"""Splitting many received lines at once, shared by the client state machine and the
capture's batch builder so that each line is split only once on the hot path.

``split_lines`` splits every line into at most five words. Lines of the form
``RDATA <stream> <instance> <token|batch> <row>`` with a valid token are the fast path;
the indices of every other line (other commands, bad tokens, blank lines) are in ``slow``
and those lines' entries in ``parts`` are placeholders."""

from __future__ import annotations

import dataclasses
import operator

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_first, _second, _third, _fourth, _fifth = (operator.itemgetter(i) for i in range(5))
# the fields of a line off the RDATA fast path: placeholders (callers parse that line by itself)
_BLANK = [b"", b"", b"", b"batch", b""]


@dataclasses.dataclass(slots=True)
class SplitLines:
    lines: list[bytes]
    parts: list[list[bytes]]
    slow: list[int]                 # sorted indices of lines not on the RDATA fast path
    tokens: list[int | None]        # RDATA token (None for batch and for slow lines)

    def streams(self) -> list[bytes]:
        return list(map(_second, self.parts))

    def instances(self) -> list[bytes]:
        return list(map(_third, self.parts))

    def rows(self) -> list[bytes]:
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
        tokens: list[int | None] = [None if t == b"batch" else int(t) for t in toks]
        if max(map(len, toks), default=0) > 18:  # may not fit the int64 token column
            raise ValueError
    except ValueError:
        tokens = []
        for i, t in enumerate(toks):
            if t == b"batch":
                tokens.append(None)
            elif (t.isascii() and t.lstrip(b"-").isdigit() and len(t) <= 20
                  and INT64_MIN <= int(t) <= INT64_MAX):
                tokens.append(int(t))
            else:
                # not a token we can store (not an integer, or beyond int64): the line
                # takes the per-line path and is recorded with its decode_error
                tokens.append(None)
                parts[i] = _BLANK
                slow.add(i)
    return SplitLines(lines, parts, sorted(slow), tokens)


# -- the vectorised scan used on the capture hot path ---------------------------------------

import numpy as np  # noqa: E402 - kept beside the code that needs it

_RDATA = np.frombuffer(b"RDATA ", np.uint8)
_BATCH = np.frombuffer(b"batch", np.uint8)
_FNV_PRIME = np.uint64(1099511628211)
_MIX = np.uint64(0x9E3779B97F4A7C15)


class Scan:
    """A block of complete lines (``buf`` ends with b"\\n") scanned with numpy: line
    boundaries, the four separating spaces of RDATA lines, tokens, and a dictionary of the
    (stream, instance) keys. ``fast`` marks well-formed RDATA lines; when ``all_fast`` is
    False, callers take the per-line path with ``lines()``."""

    __slots__ = ("buf", "arr", "n", "starts", "ends", "fast", "all_fast", "s4", "tokens",
                 "is_batch", "inv", "keys", "_lines")

    def __init__(self, buf: bytes):
        self.buf = buf
        arr = self.arr = np.frombuffer(buf, np.uint8)
        nl = np.flatnonzero(arr == 10)
        n = self.n = len(nl)
        self._lines: list[bytes] | None = None
        starts = np.empty(n, np.int64)
        if n:
            starts[0] = 0
            starts[1:] = nl[:-1] + 1
        ends = nl.astype(np.int64)
        self.starts, self.ends = starts, ends
        self.keys: list[tuple[bytes, bytes]] = []
        self.inv = np.zeros(n, np.int64)
        self.tokens = np.zeros(n, np.int64)
        self.is_batch = np.zeros(n, bool)
        self.s4 = ends
        self.fast = np.zeros(n, bool)
        self.all_fast = False
        if n == 0:
            return
        last = len(arr) - 1
        fast = (ends - starts) >= 12
        for j, c in enumerate(_RDATA):
            fast &= arr[np.minimum(starts + j, last)] == c
        sp = np.flatnonzero(arr == 32)
        if len(sp) < 4 or not fast.any():
            return
        k = np.searchsorted(sp, starts)
        top = len(sp) - 1
        s1 = sp[np.minimum(k, top)]
        s2 = sp[np.minimum(k + 1, top)]
        s3 = sp[np.minimum(k + 2, top)]
        s4 = sp[np.minimum(k + 3, top)]
        fast &= (k + 3 <= top) & (s4 < ends) & (s2 > s1 + 1) & (s3 > s2 + 1) & (s4 > s3 + 1)
        tstart = s3 + 1
        tlen = s4 - tstart
        is_batch = fast & (tlen == 5)
        for j, c in enumerate(_BATCH):
            is_batch &= arr[np.minimum(tstart + j, last)] == c
        numeric = fast & ~is_batch & (tlen <= 18)
        tok = np.zeros(n, np.int64)
        maxl = int(tlen[numeric].max()) if numeric.any() else 0
        for j in range(maxl):
            m = numeric & (j < tlen)
            d = arr[np.minimum(tstart + j, last)].astype(np.int64) - 48
            numeric &= ~m | ((d >= 0) & (d <= 9))
            tok = np.where(m, tok * 10 + d, tok)
        fast &= is_batch | numeric
        # (stream, instance) keys: two 64-bit hashes of the bytes between the first and the
        # third space; the second one checks the first, any disagreement -> per-line path
        kstart = s1 + 1
        klen = s3 - kstart
        h1 = np.full(n, np.uint64(14695981039346656037))
        h2 = klen.astype(np.uint64)
        maxk = int(klen[fast].max()) if fast.any() else 0
        j8 = np.arange(8)
        with np.errstate(over="ignore"):
            for w in range(0, maxk, 8):
                pos = kstart[:, None] + (w + j8)[None, :]
                word = np.where((w + j8)[None, :] < klen[:, None], arr[np.minimum(pos, last)], 0)
                word = np.ascontiguousarray(word, dtype=np.uint8).view(np.uint64)[:, 0]
                h1 = (h1 ^ word) * _FNV_PRIME
                h2 = (h2 + word + np.uint64(1)) * _MIX
        h1 = np.where(fast, h1, np.uint64(0))
        uniq, first, inv = np.unique(h1, return_index=True, return_inverse=True)
        if not np.array_equal(h2[fast], h2[first[inv]][fast]):
            return
        self.fast = fast
        self.all_fast = bool(fast.all())
        self.s4 = s4
        self.tokens = np.where(fast & ~is_batch, tok, 0)
        self.is_batch = is_batch
        self.inv = inv
        self.keys = [(buf[s1[r] + 1:s2[r]], buf[s2[r] + 1:s3[r]]) if fast[r] else (b"", b"")
                     for r in first.tolist()]

    def lines(self) -> list[bytes]:
        if self._lines is None:
            self._lines = self.buf[:-1].split(b"\n") if self.n else []
        return self._lines
