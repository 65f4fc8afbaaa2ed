"""Point in time (`replay --as-of`, `--as-of-seqno`, `diff --at`): which frames count.

`AsOf(ts_ns, seqnos)` keeps the frames received at or before `ts_ns` (a frame without a
timestamp never counts), and for each vbucket VB in `seqnos` leaves out its frames with a
by_seqno above SEQNO and its snapshot markers starting above it. Rollbacks received before
the moment are therefore honoured, later ones are not. Both engines filter the frames with
this one rule: the local engine with `mask` (numpy), the Spark engine with the same
comparisons as a Column expression (spark.py)."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # loaded by mask only
    import numpy as np
    import pyarrow as pa

# the columns `mask` reads
AS_OF_COLUMNS = ["ts", "vbucket", "op", "by_seqno", "snap_start"]
INT64_MIN = -(1 << 63)


@dataclass(frozen=True)
class AsOf:
    ts_ns: int | None = None
    seqnos: tuple[tuple[int, int], ...] = ()     # (vbucket, seqno), one per vbucket

    def __bool__(self) -> bool:
        return self.ts_ns is not None or bool(self.seqnos)

    def mask(self, t: "pa.Table") -> "np.ndarray":
        """The rows of `t` (with AS_OF_COLUMNS) that count."""
        # numpy and pyarrow only here: the option parsing below loads neither (a replay whose
        # tables DuckDB writes itself never loads them)
        import numpy as np

        from dcptool.replay.rules.columns import NONE_TS, as_numpy, equals, ts_ns
        keep = np.ones(t.num_rows, bool)
        if self.ts_ns is not None:
            ts = ts_ns(t.column("ts"))
            keep &= (ts != NONE_TS) & (ts <= self.ts_ns)
        if self.seqnos:
            vb = np.where(as_numpy(t.column("vbucket").is_valid(), dtype=bool),
                          as_numpy(t.column("vbucket"), fill=0, dtype=np.int64), -1)
            seqno = as_numpy(t.column("by_seqno"), fill=INT64_MIN, dtype=np.int64)
            start = np.where(equals(t.column("op"), "snapshot_marker"),
                             as_numpy(t.column("snap_start"), fill=INT64_MIN, dtype=np.int64), INT64_MIN)
            for v, s in self.seqnos:
                keep &= ~((vb == v) & ((seqno > s) | (start > s)))
        return keep


_RFC3339 = re.compile(r"^(\d{4}-\d{2}-\d{2})[Tt ](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|z|[+-]\d{2}:\d{2})$")


def parse_timestamp(text: str) -> int:
    """RFC 3339 (`2026-01-02T03:04:05.123456789Z`, any offset, up to nine fraction digits)
    or integer nanoseconds since the epoch, as nanoseconds. ValueError with the reason."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    m = _RFC3339.match(text)
    if not m:
        raise ValueError(f"{text!r} is neither RFC 3339 (2026-01-02T03:04:05.5Z) nor integer nanoseconds")
    day, clock, frac, zone = m.groups()
    zone = "+00:00" if zone in ("Z", "z") else zone
    try:
        when = _dt.datetime.fromisoformat(f"{day}T{clock}{zone}")
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    seconds = int((when - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)).total_seconds())
    return seconds * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


def parse_vb_seqno(text: str) -> tuple[int, int]:
    """`VB:SEQNO` (vbucket 0..65535, seqno 0..2**63-1). ValueError with the reason."""
    vb, sep, seqno = text.strip().partition(":")
    if not sep or not vb.isdigit() or not seqno.isdigit():
        raise ValueError(f"{text!r} is not VB:SEQNO (e.g. 5:1200)")
    vb_i, seqno_i = int(vb), int(seqno)
    if vb_i > 0xFFFF:
        raise ValueError(f"vbucket {vb_i} is above 65535")
    if seqno_i >= 1 << 63:
        raise ValueError(f"seqno {seqno_i} is above 2^63-1")
    return vb_i, seqno_i


def make_as_of(ts_text: str | None, seqno_texts=()) -> AsOf:
    """An AsOf from the option texts (the last VB:SEQNO of a vbucket wins)."""
    seqnos = dict(parse_vb_seqno(x) for x in seqno_texts)
    return AsOf(None if ts_text is None else parse_timestamp(ts_text), tuple(sorted(seqnos.items())))
