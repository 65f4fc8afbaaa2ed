"""`dcptool diff`: the documents added, changed and removed between two `documents` tables
(two captures, or two moments of one capture).

A document is (vbucket, collection_id, key). It is `added` when only the second table has
it, `removed` when only the first has it, and `changed` when both have it and any of
COMPARED differs (the columns that describe the document's version; capture_id, frame_no
and ts say where it was seen, not what it is). Rows come sorted by (vbucket,
collection_id, key), nulls first."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.rules import tables as T

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
    kind = pc.if_else(pc.invert(in_a), "added",
                      pc.if_else(pc.invert(in_b), "removed", pc.if_else(changed, "changed", None)))
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
