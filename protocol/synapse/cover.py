"""Token ranges a Synapse catch-up fetched whole, per (stream, instance): the lines of
direction `catch-up` end each page with `POSITION stream instance FROM UPTO`, the writer's word
that these are all the rows with a token in (FROM, UPTO] (CAPTURE_FORMAT.md "Caught-up lines").
Shared by --resume (replay/store/resume.py), the replay rules, verify and inspect; sans-IO."""

from __future__ import annotations

CATCH_UP = "catch-up"          # the direction of the lines a catch-up fetched
Key = tuple[str, str]          # (stream, instance)


class Cover:
    """Token ranges (a, b] fetched whole, per key, merged when they touch."""

    def __init__(self) -> None:
        self.ranges: dict[Key, list[list[int]]] = {}

    def add(self, key: Key, a: int, b: int) -> None:
        if b <= a:
            return
        rs = sorted(self.ranges.get(key, []) + [[a, b]])
        merged = [rs[0]]
        for r in rs[1:]:
            if r[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], r[1])
            else:
                merged.append(r)
        self.ranges[key] = merged

    def covers(self, key: Key, a: int, b: int) -> bool:
        """Rows (a, b] are all known."""
        return any(lo <= a and b <= hi for lo, hi in self.ranges.get(key, ()))

    def within(self, key: Key, token: int) -> bool:
        return any(lo < token <= hi for lo, hi in self.ranges.get(key, ()))
