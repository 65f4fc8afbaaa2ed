"""Option values as users write them: vbucket lists ('0-15,32'), sizes ('256MiB') and
durations ('30s', '5m'). No click: a bad value raises BadSource with the option's name as
its hint, which cli/ turns into a usage error."""

from __future__ import annotations

import re

from dcptool.protocol.errors import BadSource

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
_SECONDS = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}


def vbucket_list(text: str, limit: int = 1024, hint: str = "--vbuckets") -> list[int]:
    """'0-15,32' -> [0..15, 32], sorted, each once."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
        except ValueError:
            raise BadSource(f"not a vbucket range: {part!r}", hint) from None
        if lo > hi:
            raise BadSource(f"vbucket range {part!r} is reversed: write {hi}-{lo}", hint)
        if lo < 0 or hi >= limit:
            raise BadSource(f"vbucket range {part!r} outside 0-{limit - 1}", hint)
        out.update(range(lo, hi + 1))
    if not out:
        raise BadSource("no vbuckets selected", hint)
    return sorted(out)


def size_bytes(text: str, hint: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise BadSource(f"not a size: {text!r} (e.g. 256MiB)", hint)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def duration_seconds(text: str, hint: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise BadSource(f"not a duration: {text!r} (e.g. 30s, 5m)", hint)
    return float(m.group(1)) * _SECONDS[m.group(2)]
