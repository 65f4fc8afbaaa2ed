"""The numbers of `dcptool report`'s summary strip that come from the replay's tables (the
in-process engine, REPLAY.md), not from the pass over the frames (report_data.py): DCP the
documents by state and the rollbacks with the documents they undid; Synapse each stream and
instance's position (token, rows, gaps) and the gaps left after any catch-up."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.local.engine import replay_local
from dcptool.replay.store import reader


def _counts(t: pa.Table, column: str) -> dict[str, int]:
    if not t.num_rows:
        return {}
    col = t.column(column)
    if pa.types.is_dictionary(col.type):
        col = col.cast(pa.string())
    vc = pc.value_counts(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    return {str(v["values"]): int(v["counts"]) for v in vc.to_pylist()}


def _sum(t: pa.Table, column: str) -> int:
    if not t.num_rows or column not in t.column_names:
        return 0
    return int(pc.sum(t.column(column)).as_py() or 0)


def dcp_numbers(files: list[reader.CaptureFile]) -> dict:
    """documents: state -> count (`live`, `deleted`, `expired`); rollbacks; undone (the
    documents the rollbacks undid: the `rollbacks` table's `undone` summed)."""
    rep = replay_local(files, tables=["documents", "rollbacks"])
    docs = rep.table("documents").select(["state"])
    rb = rep.table("rollbacks")
    return {"documents": _counts(docs, "state"), "rollbacks": rb.num_rows, "undone": _sum(rb, "undone")}


def synapse_numbers(files: list[reader.CaptureFile]) -> dict:
    """positions: one dict per stream and instance (stream, instance, token, rows, gaps,
    dropped), by stream then instance; gaps: the gaps left (after catch-up) and the tokens
    they skip."""
    rep = replay_local(files, tables=["positions", "gaps"])
    pos = rep.table("positions")
    keep = [c for c in ("stream", "instance", "token", "rows", "gaps", "dropped") if c in pos.column_names]
    rows = sorted(pos.select(keep).to_pylist(), key=lambda r: (str(r["stream"]), str(r["instance"])))
    gaps = rep.table("gaps")
    skipped = 0
    if gaps.num_rows:
        skipped = _sum(pa.table({"d": pc.subtract(gaps.column("to_token"), gaps.column("from_token"))}), "d")
    return {"positions": rows, "gaps": gaps.num_rows, "gap_tokens": skipped}


def numbers(files: list[reader.CaptureFile]) -> dict:
    return dcp_numbers(files) if reader.protocol_of(files) == "dcp" else synapse_numbers(files)
