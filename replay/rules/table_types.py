"""The result tables of REPLAY.md by name, and the columns of the plan tables
(replay/rules/plans.py PLAN_TABLES) as DuckDB types and their keys, without pyarrow: the names
`--table` takes (replay/results.py table_choice), and what DuckDB casts a plan's result to when it writes an `-o` file itself
(replay/local/duck.py DuckFrames.write). The same schemas as replay/rules/tables.py, spelled
as DuckDB types (tests/replay/test_duck_files.py pins them to it): uint16 is USMALLINT,
binary BLOB, a timestamp[ns, UTC] TIMESTAMPTZ_NS (Parquet TIMESTAMP(NANOS, UTC)) and so on."""

from __future__ import annotations

# the tables of each protocol, in tables.py's order (frames last)
TABLE_NAMES: dict[str, tuple[str, ...]] = {
    "dcp": ("documents", "vbuckets", "snapshots", "rollbacks", "failover", "undone", "history", "topology", "lag",
            "frames"),
    "synapse": ("positions", "rows", "gaps", "commands", "lag", "frames"),
}


def tables_help(indent: str) -> str:
    """The tables of both protocols for `replay --help`, wrapped to fit 80 columns."""
    import textwrap
    lines = []
    for label, protocol in (("DCP", "dcp"), ("Synapse", "synapse")):
        head = f"{label} tables: "
        lines += textwrap.wrap(" ".join(TABLE_NAMES[protocol]), 76, initial_indent=head,
                               subsequent_indent=" " * len(head))
    return f"\n{indent}".join(lines)

_TS = "TIMESTAMPTZ_NS"
# the body columns of `documents` and `history` (replay/rules/bodies.py), last in both
BODY_COLUMNS = ("value", "xattrs", "value_json")
_BODY = (("value", "BLOB"), ("xattrs", "VARCHAR"), ("value_json", "VARCHAR"))

PLAN_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "documents": (("vbucket", "USMALLINT"), ("collection_id", "UINTEGER"), ("key", "BLOB"), ("by_seqno", "BIGINT"),
                  ("rev_seqno", "BIGINT"), ("cas", "UBIGINT"), ("state", "VARCHAR"), ("datatype", "UTINYINT"),
                  ("item_flags", "UINTEGER"), ("expiration", "UINTEGER"), ("value_len", "UINTEGER"),
                  ("capture_id", "VARCHAR"), ("frame_no", "BIGINT"), ("ts", _TS)) + _BODY,
    "undone": (("vbucket", "USMALLINT"), ("capture_id", "VARCHAR"), ("frame_no", "BIGINT"), ("ts", _TS),
               ("rollback_seqno", "BIGINT"), ("collection_id", "UINTEGER"), ("key", "BLOB"), ("by_seqno", "BIGINT"),
               ("op", "VARCHAR"), ("change_capture_id", "VARCHAR"), ("change_frame_no", "BIGINT"),
               ("change_ts", _TS), ("restored", "BOOLEAN"), ("restored_seqno", "BIGINT")),
    "rollbacks": (("vbucket", "USMALLINT"), ("capture_id", "VARCHAR"), ("frame_no", "BIGINT"), ("ts", _TS),
                  ("rollback_seqno", "BIGINT"), ("undone", "BIGINT")),
    "failover": (("vbucket", "USMALLINT"), ("position", "INTEGER"), ("vbucket_uuid", "UBIGINT"), ("seqno", "BIGINT")),
    "history": (("vbucket", "USMALLINT"), ("collection_id", "UINTEGER"), ("key", "BLOB"), ("by_seqno", "BIGINT"),
                ("op", "VARCHAR"), ("state", "VARCHAR"), ("rev_seqno", "BIGINT"), ("cas", "UBIGINT"),
                ("datatype", "UTINYINT"), ("item_flags", "UINTEGER"), ("expiration", "UINTEGER"),
                ("value_len", "UINTEGER"), ("snap_flags", "UINTEGER"), ("capture_id", "VARCHAR"),
                ("frame_no", "BIGINT"), ("ts", _TS)) + _BODY,
}

# each table's key: its canonical order (nulls first, blobs bytewise)
PLAN_KEYS: dict[str, tuple[str, ...]] = {
    "documents": ("vbucket", "collection_id", "key"),
    "undone": ("vbucket", "capture_id", "frame_no", "collection_id", "key", "by_seqno", "change_capture_id",
               "change_frame_no"),
    "rollbacks": ("vbucket", "capture_id", "frame_no"),
    "failover": ("vbucket", "position"),
    "history": ("vbucket", "collection_id", "key", "by_seqno"),
}
