"""What a capture holds, without replaying it (`dcptool inspect`): files, rows, time span,
rows per `op` (DCP) or `command` (Synapse), rows per node, per-vbucket seqno ranges,
snapshots, rollbacks, stream ends, cluster config revisions and decode errors; for Synapse, positions per stream and the gaps in them.
Segments are read chunk by chunk and only the columns needed (`raw` only where a cluster
config is), so memory does not grow with the capture."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.wire.constants import Status, stream_end_reason_name
from dcptool.protocol.synapse.cover import Cover
from dcptool.protocol.text import ranges_text
from dcptool.replay.rules.lag import local_lag
from dcptool.replay.rules.synapse_stream import PositionScan
from dcptool.replay.rules.topology import local_topology
from dcptool.replay.store import reader, retained
from dcptool.replay.store.files import shown
from dcptool.replay.store.reader import CaptureError, find_captures
from dcptool.replay.timestamps import iso_ns

if TYPE_CHECKING:
    from dcptool.replay.rules.synapse_stream import PositionScan

_DCP_COLUMNS = ["frame_no", "capture_id", "node", "ts", "direction", "decode_error", "op", "status",
                "vbucket", "by_seqno", "snap_start", "snap_end", "stream_end_reason",
                "rollback_seqno"]
_SYN_COLUMNS = ["frame_no", "capture_id", "conn", "node", "ts", "direction", "decode_error", "command",
                "stream", "instance", "token", "batch", "prev_token", "new_token"]
_MAX_EXAMPLES = 10


_iso = iso_ns


def _started(text: str) -> str:
    """A segment's dcptool.started_at metadata (microseconds) in the output contract's form."""
    t = reader.parse_started(text)
    return _iso((int(t.timestamp()) * 1_000_000 + t.microsecond) * 1000)


def _plain(arr):
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _counts(arr) -> dict:
    out = {}
    for item in pc.value_counts(_plain(arr)).to_pylist():
        out[item["values"]] = item["counts"]
    return out


def _add(into: dict, more: dict) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


# rows per chunk read: memory depends on this, not on the length of a segment
CHUNK_ROWS = 1 << 18


def _chunks(f, cols):
    """The rows of one segment in frame_no order, CHUNK_ROWS at a time. A finished segment
    (frame numbers increase, checked on that column alone) is streamed; anything else is
    read whole and sorted (an in-progress segment is at most one rotation in size)."""
    if not f.in_progress and reader.frame_range(f) is not None:
        yield from reader.stream_file(f, cols, CHUNK_ROWS, threads=False)
        return
    t = reader.read_file(f, cols)
    for start in range(0, t.num_rows, CHUNK_ROWS):
        yield t.slice(start, CHUNK_ROWS)


def summarize(paths) -> dict:
    """The inspect summary of the captures named by `paths` (files or directories), read
    chunk by chunk: memory does not grow with the capture."""
    files = find_captures(paths)
    if not files:
        raise CaptureError(f"no capture files found in {', '.join(map(shown, paths))}")
    protocol = files[0].protocol
    s = _Summary(protocol)
    cols = _DCP_COLUMNS if protocol == "dcp" else _SYN_COLUMNS
    if protocol == "dcp":
        _dcp_files(s, files, cols)
    for f in files if protocol == "synapse" else ():
        s.file(f)
        last_conn = None
        for t in _chunks(f, cols):
            s.chunk(f, t)
            if protocol == "synapse" and t.num_rows:
                last_conn = t.column("conn")[-1].as_py()
        if s.syn is not None and s.files[-1]["rows"]:      # (synapse)
            # a change of connection drops the rows still waiting for a token (REPLAY.md)
            s.syn.connection((f.capture_id, last_conn))
    if protocol == "dcp":
        s.configs = _configs(files)
        s.largest_lag = largest_lag(files)
    out = s.result()
    out["retained"] = retained_window(paths)
    return out


def retained_window(paths) -> dict | None:
    """What the retention rings of the captures' directories dropped (replay/store/retained.py),
    None when none did: the record files, the totals, per DCP vbucket the last seqno dropped
    (its changes up to it are gone), per Synapse stream and instance the last token dropped,
    and `note`, the line replay prints."""
    records = retained.records_near(paths)
    if not any(int(r.get("segments_dropped") or 0) for r in records):
        return None
    vbs: dict[int, int] = {}
    for rec in records:
        for vb, d in (rec.get("vbuckets") or {}).items():
            vbs[int(vb)] = max(vbs.get(int(vb), 0), int(d.get("last_seqno") or 0))
    return {"records": [retained.record_name(r.get("shard")) for r in records],
            "segments_dropped": sum(int(r.get("segments_dropped") or 0) for r in records),
            "rows_dropped": sum(int(r.get("rows_dropped") or 0) for r in records),
            "bytes_dropped": sum(int(r.get("bytes_dropped") or 0) for r in records),
            "vbuckets": [{"vbucket": vb, "last_seqno": vbs[vb]} for vb in sorted(vbs)],
            "streams": [dict(e) for rec in records for e in rec.get("streams") or ()],
            "note": retained.describe(records)}


def _dcp_files(s: "_Summary", files, cols) -> None:
    """DCP segments into the summary in replay order; a run of small finished segments of one
    capture is read in one scan and counted per file by its footer (reader.runs)."""
    for group, streamable in reader.capture_groups(files):
        for run in (reader.runs(group, CHUNK_ROWS) if streamable else ([f] for f in group)):
            if len(run) > 1:
                for f in run:
                    s.file(f)
                    s.files[-1]["rows"] = reader.footer(f.path).num_rows
                s.chunk(run[0], reader.read_segments(run, cols), per_file=False)
                continue
            s.file(run[0])
            for t in _chunks(run[0], cols):
                s.chunk(run[0], t)


def largest_lag(files) -> dict | None:
    """The largest recorded lag (the `lag` table of replay/rules/lag.py, which reads `raw`
    only in row groups that hold a lag poll): its size, vbucket, node and when, the first
    such on a tie; None when the captures hold no lag poll."""
    rows = local_lag(files).to_pylist()
    if not rows:
        return None
    best = max(rows, key=lambda r: (r["lag_items"], -int(r["ts"].value), -r["vbucket"]))
    return {"lag_items": best["lag_items"], "vbucket": best["vbucket"], "node": best["node"],
            "ts": _iso(int(best["ts"].value)), "high_seqno": best["high_seqno"], "seqno": best["seqno"],
            "polls": len({(r["capture_id"], r["frame_no"]) for r in rows})}


def lag_text(lag: dict | None) -> str:
    """inspect's line for the largest recorded lag."""
    if not lag:
        return "largest lag: none recorded (no lag poll answered for a vbucket with a position)"
    return (f"largest lag: {lag['lag_items']:,} items, vbucket {lag['vbucket']} on {lag['node']} at {lag['ts']} "
            f"({lag['polls']:,} lag polls)")


def _configs(files) -> list[dict]:
    """One entry per cluster config revision the captures hold (the `topology` table of
    replay/rules/topology.py, which reads `raw` only in row groups that hold a config)."""
    out: dict[tuple, dict] = {}
    for r in local_topology(files).to_pylist():
        c = out.get((r["rev_epoch"], r["rev"]))
        if c is None:
            c = out[(r["rev_epoch"], r["rev"])] = {
                "rev_epoch": r["rev_epoch"], "rev": r["rev"], "capture_id": r["capture_id"],
                "frame_no": r["frame_no"], "ts": _iso(int(r["ts"].value)) if r["ts"] is not None else None,
                "node": r["node"], "via": r["via"], "vbuckets": 0, "active": {}}
        c["vbuckets"] += 1
        a = r["active"] if r["active"] is not None else "none"
        c["active"][a] = c["active"].get(a, 0) + 1
    for c in out.values():
        c["active"] = dict(sorted(c["active"].items()))
    return [out[k] for k in sorted(out)]


class _Summary:
    def __init__(self, protocol: str):
        self.protocol = protocol
        self.files: list[dict] = []
        self.captures: dict[str, dict] = {}
        self.rows = 0
        self.ts_min = self.ts_max = None
        self.directions: dict = {}
        self.nodes: dict = {}           # "host:port" -> rows (version 2 captures)
        self.configs: list[dict] = []   # DCP: cluster config revisions
        self.largest_lag: dict | None = None   # DCP: the largest recorded lag (largest_lag)
        self.kinds: dict = {}           # op or command -> rows
        self.decode_errors = 0
        self.error_examples: list[dict] = []
        # DCP
        self.vbs: dict[int, dict] = {}
        self.rollbacks: list[dict] = []
        self.stream_ends: list[dict] = []
        # Synapse
        self.syn: PositionScan | None = None
        if protocol == "synapse":
            self.syn = PositionScan()
            self.cover = Cover()            # ranges a catch-up fetched (REPLAY.md "Caught-up rows")
            self.caught_up_rows = 0

    # -- per segment ---------------------------------------------------------------------

    def file(self, f) -> None:
        self.files.append({"path": shown(f.path), "capture_id": f.capture_id, "segment": f.segment,
                           "in_progress": f.in_progress, "started_at": _started(f.started_at), "rows": 0})
        cap = self.captures.setdefault(f.capture_id, {
            "capture_id": f.capture_id, "started_at": _started(f.started_at),
            "source": f.metadata.get("dcptool.source"), "version": f.metadata.get("dcptool.version"),
            "segments": 0, "rows": 0})
        cap["segments"] += 1

    def chunk(self, f, t, per_file: bool = True) -> None:
        """The next rows of the segment last passed to file() (per_file False: rows of a run
        of segments of f's capture, already counted per file)."""
        n = t.num_rows
        if per_file:
            self.files[-1]["rows"] += n
        self.captures[f.capture_id]["rows"] += n
        self.rows += n
        if n == 0:
            return
        ts = pc.min_max(t.column("ts").cast("int64"))
        lo, hi = ts["min"].as_py(), ts["max"].as_py()
        if lo is not None:
            self.ts_min = lo if self.ts_min is None else min(self.ts_min, lo)
            self.ts_max = hi if self.ts_max is None else max(self.ts_max, hi)
        _add(self.directions, _counts(t.column("direction")))
        _add(self.nodes, {k: v for k, v in _counts(t.column("node")).items() if k is not None})
        _add(self.kinds, _counts(t.column("op" if self.protocol == "dcp" else "command")))
        errs = t.filter(pc.is_valid(t.column("decode_error")))
        self.decode_errors += errs.num_rows
        for row in errs.slice(0, _MAX_EXAMPLES - len(self.error_examples)).to_pylist() \
                if len(self.error_examples) < _MAX_EXAMPLES else []:
            self.error_examples.append({"capture_id": f.capture_id, "frame_no": row["frame_no"],
                                        "error": row["decode_error"]})
        if self.protocol == "dcp":
            self._dcp(f, t)
        else:
            self._synapse(f, t)

    def _vb(self, vb: int) -> dict:
        d = self.vbs.get(vb)
        if d is None:
            d = self.vbs[vb] = {"vbucket": vb, "items": 0, "first_seqno": None, "last_seqno": None,
                                "min_seqno": None, "max_seqno": None, "snapshots": 0,
                                "rollbacks": 0, "stream_end_reason": None}
        return d

    def _dcp(self, f, t) -> None:
        is_in = pc.fill_null(pc.equal(_plain(t.column("direction")), "in"), False)
        op = _plain(t.column("op"))
        items = t.filter(pc.and_(pc.and_(is_in, pc.is_null(t.column("status"))),
                                 pc.is_valid(t.column("by_seqno"))))
        if items.num_rows:
            g = items.select(["vbucket", "by_seqno"]).group_by("vbucket", use_threads=False).aggregate(
                [("by_seqno", "first"), ("by_seqno", "last"), ("by_seqno", "count"),
                 ("by_seqno", "min"), ("by_seqno", "max")])
            for r in g.to_pylist():
                if r["vbucket"] is None:
                    continue
                d = self._vb(r["vbucket"])
                if d["first_seqno"] is None:
                    d["first_seqno"] = r["by_seqno_first"]
                d["last_seqno"] = r["by_seqno_last"]
                d["items"] += r["by_seqno_count"]
                d["min_seqno"] = r["by_seqno_min"] if d["min_seqno"] is None else min(d["min_seqno"], r["by_seqno_min"])
                d["max_seqno"] = r["by_seqno_max"] if d["max_seqno"] is None else max(d["max_seqno"], r["by_seqno_max"])
        markers = t.filter(pc.and_(is_in, pc.fill_null(pc.equal(op, "snapshot_marker"), False)))
        if markers.num_rows:
            for r in pc.value_counts(markers.column("vbucket")).to_pylist():
                if r["values"] is not None:
                    self._vb(r["values"])["snapshots"] += r["counts"]
        rb = t.filter(pc.and_(is_in, pc.fill_null(pc.equal(t.column("status"), pa.scalar(int(Status.ROLLBACK), pa.uint16())), False)))
        for r in rb.select(["vbucket", "rollback_seqno", "frame_no", "ts"]).to_pylist():
            self.rollbacks.append({"vbucket": r["vbucket"], "rollback_seqno": r["rollback_seqno"],
                                   "capture_id": f.capture_id, "frame_no": r["frame_no"]})
            if r["vbucket"] is not None:
                self._vb(r["vbucket"])["rollbacks"] += 1
        ends = t.filter(pc.and_(is_in, pc.fill_null(pc.equal(op, "stream_end"), False)))
        for r in ends.select(["vbucket", "stream_end_reason", "frame_no"]).to_pylist():
            reason = r["stream_end_reason"]
            self.stream_ends.append({
                "vbucket": r["vbucket"], "reason": reason,
                "reason_name": stream_end_reason_name(reason) if reason is not None else None,
                "capture_id": f.capture_id, "frame_no": r["frame_no"]})
            if r["vbucket"] is not None:
                self._vb(r["vbucket"])["stream_end_reason"] = reason

    def _synapse(self, f, t) -> None:
        is_in = pc.fill_null(pc.equal(_plain(t.column("direction")), "in"), False)
        cmd = _plain(t.column("command"))
        wanted = pc.and_(is_in, pc.fill_null(pc.is_in(cmd, value_set=pa.array(["RDATA", "POSITION"])),
                                             False))
        rel = t.filter(wanted)
        if rel.num_rows and self.syn is not None:
            self.syn.feed(f.capture_id, rel)
        caught = t.filter(pc.fill_null(pc.equal(_plain(t.column("direction")), "catch-up"), False))
        if caught.num_rows:
            d = caught.select(["command", "stream", "instance", "prev_token", "new_token"]).to_pydict()
            for c, s, i, a, b in zip(d["command"], d["stream"], d["instance"], d["prev_token"], d["new_token"]):
                if c == "RDATA":
                    self.caught_up_rows += 1
                elif c == "POSITION" and a is not None and b is not None:
                    self.cover.add((s, i), a, b)

    # -- result --------------------------------------------------------------------------

    def result(self) -> dict:
        span = None
        if self.ts_min is not None:
            span = {"first": _iso(self.ts_min), "last": _iso(self.ts_max),
                    "seconds": (self.ts_max - self.ts_min) / 1e9}
        out = {
            "protocol": self.protocol,
            "files": self.files,
            "captures": list(self.captures.values()),
            "rows": self.rows,
            "time_span": span,
            "directions": dict(sorted(self.directions.items(), key=lambda kv: str(kv[0]))),
            "nodes": dict(sorted(self.nodes.items())),
        }
        kinds = dict(sorted(self.kinds.items(), key=lambda kv: (-kv[1], str(kv[0]))))
        if self.protocol == "dcp":
            out["ops"] = kinds
            out["vbuckets"] = [self.vbs[k] for k in sorted(self.vbs)]
            out["snapshots"] = sum(v["snapshots"] for v in self.vbs.values())
            out["rollbacks"] = self.rollbacks
            out["stream_ends"] = self.stream_ends
            out["configs"] = self.configs
            out["largest_lag"] = self.largest_lag
        elif self.syn is not None:      # (synapse)
            out["commands"] = kinds
            positions, gaps = self.syn.result()
            out["gaps"] = left = [g for g in gaps if not self.cover.covers((g["stream"], g["instance"]),
                                                                           g["from_token"], g["to_token"])]
            for p in positions:      # gaps a catch-up filled are no gaps
                p["gaps"] = sum(1 for g in left if (g["stream"], g["instance"]) == (p["stream"], p["instance"]))
            out["positions"] = positions
            out["caught_up_rows"] = self.caught_up_rows
        out["decode_errors"] = {"count": self.decode_errors, "examples": self.error_examples}
        return out


# ---- inspect's tables: per-vbucket rows collapsed into vbucket ranges (issue 39)

VB_KEYS = ("items", "first_seqno", "last_seqno", "min_seqno", "max_seqno", "snapshots", "rollbacks",
            "stream_end_reason")
MAX_VB_ROWS = 32   # more (after collapsing) and the vbuckets table is a min / max / total summary


def vb_ranges(vbs: Iterable[int], limit: int | None = None) -> str:
    """Vbucket numbers as ranges: [0, 1, 2, 3, 7, 9, 10] -> `0-3,7,9-10`; past `limit` ranges the
    first ones, then `… (N vbuckets)`."""
    ordered = set(vbs)
    out = ranges_text(ordered).split(",") if ordered else []
    if limit is not None and len(out) > limit:
        return ",".join(out[:limit]) + f",… ({len(ordered):,} vbuckets)"
    return ",".join(out)


def collapsed(rows: Iterable[tuple[int, Sequence[str], int | None]]) -> list[tuple[str, ...]]:
    """(vbucket, cells, frame_no) rows with identical cells as one row per cells: the vbuckets as
    ranges, the frame_no alone or as `first..last` (in order of first appearance)."""
    groups: dict[tuple[str, ...], tuple[list[int], list[int | None]]] = {}
    for vb, cells, frame_no in rows:
        vbs, frames = groups.setdefault(tuple(cells), ([], []))
        vbs.append(vb)
        frames.append(frame_no)
    out = []
    for cells, (vbs, frames) in groups.items():
        known = [f for f in frames if f is not None]
        span = "" if not known else str(known[0]) if min(known) == max(known) else f"{min(known)}..{max(known)}"
        out.append((vb_ranges(vbs, limit=8), *cells, span))
    return out


def vb_runs(rows: list[dict[str, Any]]) -> list[tuple[list[int], tuple[str, ...]]]:
    """`inspect`'s per-vbucket rows (VB_KEYS as text) as runs of consecutive vbuckets whose
    rows are identical but for the vbucket: [(vbuckets, cells)] in vbucket order."""
    runs: list[tuple[list[int], tuple[str, ...]]] = []
    for v in sorted(rows, key=lambda r: r["vbucket"]):
        cells = tuple("" if v[k] is None else str(v[k]) for k in VB_KEYS)
        if runs and runs[-1][1] == cells and runs[-1][0][-1] + 1 == v["vbucket"]:
            runs[-1][0].append(v["vbucket"])
        else:
            runs.append(([v["vbucket"]], cells))
    return runs


def vb_totals(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """min / max / total of each numeric VB_KEYS column (no total of seqnos), as text."""
    out = []
    for name, fn in (("min", min), ("max", max), ("total", sum)):
        cells = []
        for k in VB_KEYS[:-1]:
            vals = [v[k] for v in rows if v[k] is not None]
            cells.append("" if not vals or (name == "total" and "seqno" in k) else f"{fn(vals):,}")
        out.append((name, cells))
    return out


def vb_end_groups(rows: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The vbuckets of each stream end reason (`open` for none)."""
    ends: dict[str, list[int]] = {}
    for v in rows:
        ends.setdefault("open" if v["stream_end_reason"] is None else str(v["stream_end_reason"]),
                        []).append(v["vbucket"])
    return ends


VB_HEAD = ("items", "first seqno", "last seqno", "min", "max", "snapshots", "rollbacks", "stream end")


def vb_table(rows: list[dict[str, Any]]) -> tuple[str, tuple[str, ...], list[tuple[str, ...]], str | None]:
    """(title, header, rows, line) of `inspect`'s vbuckets table: runs of identical rows
    (vb_runs), or past MAX_VB_ROWS runs a min / max / total table and a line of the vbuckets of
    each stream end reason (line is None for the runs)."""
    runs = vb_runs(rows)
    if len(runs) <= MAX_VB_ROWS:
        return "vbuckets", ("vbuckets", *VB_HEAD), [(vb_ranges(vbs), *cells) for vbs, cells in runs], None
    title = f"vbuckets ({len(rows):,}: {vb_ranges(v['vbucket'] for v in rows)}; every row with --json)"
    line = "stream end per vbucket: " + "; ".join(f"{k}: {len(vbs):,} ({vb_ranges(vbs, limit=4)})"
                                                  for k, vbs in vb_end_groups(rows).items())
    return title, ("", *VB_HEAD[:-1]), [(name, *cells) for name, cells in vb_totals(rows)], line
