"""`dcptool diff`: the documents added, changed and removed between two `documents` tables
(two captures, or two moments of one capture).

A document is (vbucket, collection_id, key). It is `added` when only the second table has
it or it went from deleted/expired to live, `removed` when only the first has it or it went
from live to deleted/expired, and `changed` when both have it and any of COMPARED differs
otherwise (the columns that describe the document's version; capture_id, frame_no and ts say
where it was seen, not what it is). Rows come sorted by (vbucket, collection_id, key), nulls
first. `summary` counts each kind and, for added and removed, how (`breakdown`)."""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.errors import LateUsageError
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import parse_timestamp
from dcptool.replay.timestamps import iso_ns

COMPARED = ["by_seqno", "rev_seqno", "cas", "state", "datatype", "item_flags", "expiration", "value_len"]
SHOWN = ["by_seqno", "cas", "state"]
DIFF_SCHEMA = pa.schema([("change", pa.string()), ("vbucket", pa.uint16()), ("collection_id", pa.uint32()),
                         ("key", pa.binary())]
                        + [(f"{side}_{c}", T.schema_of("dcp", "documents").field(c).type)
                           for c in SHOWN for side in ("before", "after")])
_KEY = ["vbucket", "_cid", "_key", "_key_null"]


def _keyed(docs: pa.Table, prefix: str) -> pa.Table:
    """`docs` with join keys that match nulls too (Arrow joins never match a null key)."""
    docs = T.canonical("dcp", "documents", docs)
    cid = docs.column("collection_id")
    key = docs.column("key")
    out = {"vbucket": docs.column("vbucket"),
           "_cid": pc.fill_null(cid.cast(pa.int64()), -1),
           "_key": pc.fill_null(key, b""), "_key_null": pc.is_null(key)}
    for c in ["collection_id", "key"] + COMPARED:
        out[f"{prefix}{c}"] = docs.column(c)
    out[f"{prefix}_here"] = pa.array([True] * docs.num_rows, pa.bool_())
    return pa.table(out)


def _differs(a, b) -> pa.ChunkedArray:
    """a != b with null equal to null."""
    eq = pc.fill_null(pc.equal(a, b), False)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    return pc.invert(pc.or_(eq, both_null))


def diff_documents(before: pa.Table, after: pa.Table) -> pa.Table:
    """The differences (DIFF_SCHEMA) from `before` to `after` (`documents` tables)."""
    a, b = _keyed(before, "a_"), _keyed(after, "b_")
    j = a.join(b, keys=_KEY, join_type="full outer")
    if j.num_rows == 0:
        return DIFF_SCHEMA.empty_table()
    in_a = pc.fill_null(j.column("a__here"), False)
    in_b = pc.fill_null(j.column("b__here"), False)
    changed = pa.array([False] * j.num_rows, pa.bool_())
    for c in COMPARED:
        changed = pc.or_(changed, _differs(j.column(f"a_{c}"), j.column(f"b_{c}")))
    live_a = pc.fill_null(pc.equal(j.column("a_state"), "live"), False)
    live_b = pc.fill_null(pc.equal(j.column("b_state"), "live"), False)
    revived = pc.and_(in_a, pc.and_(pc.invert(live_a), live_b))      # deleted/expired -> live
    ended = pc.and_(in_b, pc.and_(live_a, pc.invert(live_b)))        # live -> deleted/expired
    kind = pc.if_else(pc.or_(pc.invert(in_a), revived), "added",
                      pc.if_else(pc.or_(pc.invert(in_b), ended), "removed",
                                 pc.if_else(changed, "changed", None)))
    keep = pc.is_valid(kind)
    cols = {"change": kind,
            "vbucket": j.column("vbucket"),
            "collection_id": pc.if_else(in_a, j.column("a_collection_id"), j.column("b_collection_id")),
            "key": pc.if_else(in_a, j.column("a_key"), j.column("b_key"))}
    for c in SHOWN:
        cols[f"before_{c}"] = j.column(f"a_{c}")
        cols[f"after_{c}"] = j.column(f"b_{c}")
    out = pa.table(cols).filter(keep)
    out = pa.Table.from_arrays([out.column(f.name).cast(f.type) for f in DIFF_SCHEMA], schema=DIFF_SCHEMA)
    if out.num_rows > 1:
        try:  # pyarrow >= 25: null placement per key
            opts = pc.SortOptions([(k, "ascending", "at_start") for k in ("vbucket", "collection_id", "key")])
        except (TypeError, ValueError):
            opts = pc.SortOptions([(k, "ascending") for k in ("vbucket", "collection_id", "key")],
                                  null_placement="at_start")
        out = out.take(pc.sort_indices(out, options=opts))
    return out.combine_chunks()


def summary(diff: pa.Table) -> dict[str, int]:
    """Counts of added / changed / removed."""
    counts = dict.fromkeys(("added", "changed", "removed"), 0)
    for v in diff.column("change").to_pylist():
        counts[v] += 1
    return counts


def breakdown(diff: pa.Table) -> dict[str, dict[str, int]]:
    """How the added and removed documents came and went: added as `new` (absent before) or
    `revived` (deleted/expired before); removed as `absent` (not in the second table),
    `deleted` or `expired` (its state after). Only the non-zero counts."""
    out: dict[str, dict[str, int]] = {"added": {}, "removed": {}}
    rows = zip(diff.column("change").to_pylist(), diff.column("before_state").to_pylist(),
               diff.column("after_state").to_pylist())
    for change, before, after in rows:
        if change == "added":
            how = "new" if before is None else "revived"
        elif change == "removed":
            how = "absent" if after is None else after
        else:
            continue
        out[change][how] = out[change].get(how, 0) + 1
    return out


def summary_line(diff: pa.Table, before_rows: int, after_rows: int) -> str:
    """`N added (...), N changed, N removed (...) (A -> B documents)` for stderr."""
    counts, how = summary(diff), breakdown(diff)

    def part(kind: str) -> str:
        detail = ", ".join(f"{n} {k}" for k, n in sorted(how.get(kind, {}).items()))
        return f"{counts[kind]} {kind}" + (f" ({detail})" if detail else "")
    return (f"{part('added')}, {counts['changed']} changed, {part('removed')} "
            f"({before_rows} -> {after_rows} documents)")


_RELATIVE = re.compile(r"([+-])(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def capture_span(files: list[Any]) -> tuple[int, int] | None:
    """The first and last frame timestamp (ns) of a capture's files; None without any."""
    from dcptool.replay.store import reader
    ts = reader.read_capture_table(files, ["ts"]).column("ts").cast(pa.int64())
    mm = pc.min_max(ts).as_py()
    if mm["min"] is None:
        return None
    return int(mm["min"]), int(mm["max"])


def moment_problem(text: str) -> str | None:
    """Why `--at` TEXT is no moment at all (None when it is one), before any capture is read."""
    t = text.strip().lower()
    if t in ("start", "end") or _RELATIVE.fullmatch(t):
        return None
    try:
        parse_timestamp(text)
    except ValueError as exc:
        return f"{exc} (or start, end, +30s, -5m)"
    return None


def resolve_moment(text: str, span: tuple[int, int] | None, where: str) -> int:
    """`--at` TEXT as nanoseconds: `start`, `end`, `+DURATION` (after the capture's first frame),
    `-DURATION` (before its last; DURATION as 30s, 500ms, 5m, 1.5h), RFC 3339 or integer
    nanoseconds. A moment outside the capture (`where` names it) is a LateUsageError naming
    the capture's first and last moment. ValueError for text that is none of these."""
    t = text.strip().lower()
    m = _RELATIVE.fullmatch(t)
    if span is None:
        if t in ("start", "end") or m:
            raise LateUsageError(f"--at {text}: {where} has no timestamped frames to count from")
        return parse_timestamp(text)
    first, last = span
    if t == "start":
        return first
    if t == "end":
        return last
    if m:
        amount = round(float(m.group(2)) * _UNIT_NS[m.group(3)])
        ns = first + amount if m.group(1) == "+" else last - amount
    else:
        ns = parse_timestamp(text)
    if not first <= ns <= last:
        side = "before its first frame" if ns < first else "after its last frame"
        raise LateUsageError(f"--at {text}: {iso_ns(ns)} is {side}; {where} runs from {iso_ns(first)} "
                             f"to {iso_ns(last)} (or use start, end, +30s, -5m)")
    return ns
