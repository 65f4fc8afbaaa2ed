"""The numbers behind `dcptool report` (replay/check/report.py draws them). A first pass reads
`ts` alone for the time span, which is cut into at most `max_points` equal bins; a second
pass over the capture columns in batches of 262,144 rows (about 600 MB peak RSS at 10M frames) aggregates with numpy /
pyarrow as it goes: counts per bin (frames, bytes), the highest seqno (DCP) or token
(Synapse) per vbucket or stream per bin, the marks (rollbacks, stream ends, cluster map changes,
reconnects, errors; the first of each kind in each time bin, with the bin's count), snapshot kinds, and the change count per key
(partial group-bys merged in Arrow, never a Python dict per key). Nothing here keeps one
value per frame, so memory stays bounded by the number of bins, series and keys."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dcptool.protocol.dcp.wire.constants import (
    NUM_VB_SLOTS,
    Status,
    stream_end_reason_name,
)
from dcptool.replay.local.engine import replay_local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from dcptool.replay.store.files import arrow_source

KEY_COMPACT_ROWS = 2_000_000
MIN_BIN_NS = 1_000_000     # 1 ms: finer bins would only show the receive batches
CHANGE_OPS = ["mutation", "deletion", "expiration", "commit"]
SEQNO_OPS = CHANGE_OPS + ["prepare", "abort", "system_event", "seqno_advanced"]
DCP_COLUMNS = ["ts", "conn", "direction", "op", "status", "vbucket", "by_seqno", "snap_flags",
               "stream_end_reason", "rollback_seqno", "key", "collection_id", "raw"]
SYNAPSE_COLUMNS = ["ts", "conn", "direction", "command", "stream", "instance", "token", "args", "raw"]
NS = 1_000_000_000


@dataclass
class Segment:
    name: str
    bytes: int
    rows: int | None


@dataclass
class ReportData:
    protocol: str
    segments: list[Segment]
    frames: int = 0
    bytes: int = 0
    t0_ns: int = 0                                      # first frame's ts
    t1_ns: int = 0                                      # last frame's ts
    width_ns: int = 1                                   # one time bin
    bins: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))          # bin start, ns
    frames_per_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bytes_per_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    progress: dict = field(default_factory=dict)       # series name -> (bin start ns, highest value so far)
    progress_series: int = 0                            # series seen (only the busiest are kept)
    marks: dict = field(default_factory=dict)           # kind -> [(ts ns, text, marks in its bin)] per bin
    mark_counts: dict = field(default_factory=dict)     # kind -> count
    kinds: dict = field(default_factory=dict)           # snapshot kind (DCP) / stream (Synapse) -> count
    top_keys: list = field(default_factory=list)        # (key text, collection id, changes)
    lag: dict | None = None                             # node -> (bin start ns, highest lag_items); None: no `lag` table
    retained: dict | None = None                        # what a retention ring dropped (summary.retained_window)
    caught_up: int = 0                                  # Synapse: RDATA rows a catch-up fetched (direction catch-up)
    ops: dict = field(default_factory=dict)             # op (DCP live changes) / command (Synapse) -> count per bin
    op_totals: dict = field(default_factory=dict)       # op / command -> count, inbound (DCP: backfill included)
    backfill: dict = field(default_factory=dict)        # DCP: items, first_ns, last_ns, per_bin (disk snapshots)
    unserved: list = field(default_factory=list)        # DCP: vbuckets whose every stream request was refused
    tables: dict = field(default_factory=dict)          # numbers from the replay's tables (report_tables.py)


class _Acc:
    """Running aggregates of one report."""

    def __init__(self, protocol: str, t0: int, width: int, nbins: int):
        self.protocol = protocol
        self.caught_up = 0
        self.t0, self.width, self.nbins = t0, width, nbins
        self.frames_per_bin = np.zeros(nbins, np.int64)
        self.bytes_per_bin = np.zeros(nbins, np.int64)
        self.grid = np.full((0, nbins), _LOW, np.int64)      # series row -> highest value per bin
        self.rows: dict[int, int] = {}                       # series id -> grid row
        self.series_changes: dict[int, int] = {}
        self.series_names: dict[str, int] = {}
        self.marks: dict[str, dict[int, list]] = {}     # kind -> time bin -> [ts, text, count]
        self.mark_counts: dict[str, int] = {}
        self.kinds: dict[str, int] = {}
        self.key_parts: list[pa.Table] = []
        self.key_rows = 0
        self.last_conn: int | None = None
        self.frames = 0
        self.bytes = 0
        self.ops: dict[str, np.ndarray] = {}
        self.op_totals: dict[str, int] = {}
        self.disk = np.zeros(NUM_VB_SLOTS, bool)     # DCP: the vbucket's last snapshot marker was a disk one
        self.backfill = np.zeros(nbins, np.int64)
        self.backfill_span: list[int] = []           # first and last ts of a backfill item
        self.served: set[int] = set()
        self.refused: set[int] = set()

    # -------------------------------------------------------------- common
    def bin(self, ts: np.ndarray) -> np.ndarray:
        return np.clip((ts - self.t0) // self.width, 0, self.nbins - 1)

    def rate(self, ts: np.ndarray, nbytes: np.ndarray) -> None:
        b = self.bin(ts)
        self.frames_per_bin += np.bincount(b, minlength=self.nbins)
        self.bytes_per_bin += np.bincount(b, weights=nbytes, minlength=self.nbins).astype(np.int64)
        self.frames += len(ts)
        self.bytes += int(nbytes.sum())

    def mark(self, kind: str, ts_ns: np.ndarray, texts) -> None:
        """Marks of `kind`: all counted, the first of each time bin kept (with the bin's count)."""
        n = len(ts_ns)
        if not n:
            return
        self.mark_counts[kind] = self.mark_counts.get(kind, 0) + n
        texts = list(texts)
        kept = self.marks.setdefault(kind, {})
        bins, first, counts = np.unique(self.bin(ts_ns), return_index=True, return_counts=True)
        for b, i, c in zip(bins.tolist(), first.tolist(), counts.tolist()):
            if b in kept:
                kept[b][2] += c
            else:
                kept[b] = [int(ts_ns[i]), texts[i], c]

    def reconnects(self, ts: np.ndarray, conn: np.ndarray) -> None:
        if not len(conn):
            return
        prev = np.concatenate([[conn[0] if self.last_conn is None else self.last_conn], conn[:-1]])
        idx = np.nonzero((conn != prev) & (conn > 0))[0]
        self.mark("reconnect", ts[idx], (f"connection {c}" for c in conn[idx].tolist()))
        self.last_conn = int(conn[-1])

    def progress(self, series: np.ndarray, ts: np.ndarray, value: np.ndarray) -> None:
        if not len(series):
            return
        su, inv, sn = np.unique(series, return_inverse=True, return_counts=True)
        for sid, n in zip(su.tolist(), sn.tolist()):
            if sid not in self.rows:
                self.rows[sid] = len(self.rows)
            self.series_changes[sid] = self.series_changes.get(sid, 0) + n
        if len(self.rows) > self.grid.shape[0]:
            grow = np.full((len(self.rows) - self.grid.shape[0], self.nbins), _LOW, np.int64)
            self.grid = np.vstack([self.grid, grow])
        lut = np.array([self.rows[sid] for sid in su.tolist()], np.int64)
        np.maximum.at(self.grid.reshape(-1), lut[inv] * self.nbins + self.bin(ts), value)

    def count_keys(self, keys: pa.Array, cids: pa.Array) -> None:
        if not len(keys):
            return
        t = pa.table({"key": keys, "collection_id": cids, "n": pa.array(np.ones(len(keys), np.int64))})
        self.key_parts.append(t.group_by(["key", "collection_id"]).aggregate([("n", "sum")])
                              .rename_columns(["key", "collection_id", "n"]))
        self.key_rows += self.key_parts[-1].num_rows
        if self.key_rows > KEY_COMPACT_ROWS:
            self._compact_keys()

    def _compact_keys(self) -> None:
        t = pa.concat_tables(self.key_parts)
        self.key_parts = [t.group_by(["key", "collection_id"]).aggregate([("n", "sum")])
                          .rename_columns(["key", "collection_id", "n"])]
        self.key_rows = self.key_parts[0].num_rows

    def count_ops(self, names, ts: np.ndarray, live: np.ndarray | None = None) -> None:
        """Inbound operations by name: totals, and per time bin those that are `live` (all
        when None)."""
        names = np.asarray(names, dtype=object)
        if not len(names):
            return
        b = self.bin(ts)
        for name in sorted(set(names.tolist())):
            mine = names == name
            self.op_totals[name] = self.op_totals.get(name, 0) + int(mine.sum())
            keep = mine if live is None else mine & live
            grid = self.ops.setdefault(name, np.zeros(self.nbins, np.int64))
            grid += np.bincount(b[keep], minlength=self.nbins)

    def in_backfill(self, vb: np.ndarray, marker: np.ndarray, disk: np.ndarray) -> np.ndarray:
        """For rows in wire order (`vb`, whether each is a snapshot marker, and whether that
        marker is a disk one): whether each row falls in a disk snapshot of its vbucket (the
        backfill), carrying each vbucket's last marker over from the batches before."""
        n = len(vb)
        order = np.argsort(vb, kind="stable")
        vbs, mk = vb[order], marker[order]
        idx = np.arange(n)
        start = np.r_[0, np.flatnonzero(np.diff(vbs)) + 1]
        group_start = np.repeat(start, np.diff(np.r_[start, n]))
        last = np.maximum.accumulate(np.where(mk, idx, -1))
        own = last >= group_start
        out_sorted = np.where(own, disk[order][np.maximum(last, 0)], self.disk[vbs])
        ends = np.r_[start[1:], n] - 1
        self.disk[vbs[ends]] = out_sorted[ends]
        out = np.empty(n, bool)
        out[order] = out_sorted
        return out

    # -------------------------------------------------------------- per protocol
    def _dcp_phases(self, t: pa.Table, op, inbound) -> None:
        """Changes by op (the live ones per bin), the backfill (changes inside disk snapshots),
        and which vbuckets a stream request was granted or refused."""
        is_marker = pc.equal(op, "snapshot_marker").fill_null(False)
        is_change = pc.is_in(op, pa.array(CHANGE_OPS)).fill_null(False)
        valid_vb = pc.and_(pc.is_valid(t.column("vbucket")), pc.less(t.column("vbucket"), NUM_VB_SLOTS))
        sub = t.filter(pc.and_(pc.and_(pc.or_(is_marker, is_change), inbound), valid_vb.fill_null(False)))
        if sub.num_rows:
            sop = _plain(sub.column("op"))
            marker = pc.equal(sop, "snapshot_marker").to_numpy(zero_copy_only=False)
            disk = (_int(sub.column("snap_flags"), 0) & 0x02) != 0
            back = self.in_backfill(_int(sub.column("vbucket"), 0), marker, disk)
            ts = _ns(sub.column("ts"))
            change = ~marker
            self.count_ops(np.asarray(sop.to_pylist(), dtype=object)[change], ts[change], ~back[change])
            bts = ts[change & back]
            if len(bts):
                self.backfill += np.bincount(self.bin(bts), minlength=self.nbins)
                lo, hi = int(bts.min()), int(bts.max())
                self.backfill_span = [min(self.backfill_span[0], lo), max(self.backfill_span[1], hi)] \
                    if self.backfill_span else [lo, hi]
        rsp = t.filter(pc.and_(pc.and_(pc.equal(op, "stream_req").fill_null(False), inbound),
                               pc.is_valid(t.column("status"))))
        if rsp.num_rows:
            vbs, st = _int(rsp.column("vbucket"), -1), _int(rsp.column("status"), 0)
            self.served.update(vbs[st == 0].tolist())
            self.refused.update(vbs[(st != 0) & (st != int(Status.ROLLBACK))].tolist())

    def feed_dcp(self, t: pa.Table) -> None:
        ts = _ns(t.column("ts"))
        self.rate(ts, _lengths(t.column("raw")))
        self.reconnects(ts, _int(t.column("conn"), -1))
        op = t.column("op").cast(pa.string()) if pa.types.is_dictionary(t.column("op").type) else t.column("op")
        inbound = pc.equal(t.column("direction"), "in").fill_null(False)
        seq = pc.and_(pc.is_in(op, pa.array(SEQNO_OPS)).fill_null(False),
                      pc.is_valid(t.column("by_seqno")))
        sub = t.filter(pc.and_(seq, inbound))
        self.progress(_int(sub.column("vbucket"), 0), _ns(sub.column("ts")), _int(sub.column("by_seqno"), 0))
        changes = t.filter(pc.and_(pc.is_in(op, pa.array(CHANGE_OPS)).fill_null(False), inbound))
        self.count_keys(changes.column("key").combine_chunks(),
                        changes.column("collection_id").combine_chunks())
        self._dcp_marks(t, op, inbound)
        self._dcp_kinds(t, op)
        self._dcp_phases(t, op, inbound)

    def _dcp_marks(self, t: pa.Table, op, inbound) -> None:
        rb = t.filter(pc.and_(pc.and_(pc.equal(op, "stream_req").fill_null(False), inbound),
                              pc.equal(t.column("status"), int(Status.ROLLBACK)).fill_null(False)))
        self.mark("rollback", _ns(rb.column("ts")),
                  (f"vbucket {v} rolled back to seqno {s}" for v, s in
                   zip(rb.column("vbucket").to_pylist(), rb.column("rollback_seqno").to_pylist())))
        se = t.filter(pc.and_(pc.equal(op, "stream_end").fill_null(False),
                              pc.greater(t.column("stream_end_reason"), 1).fill_null(False)))
        self.mark("stream end (failover, rebalance...)", _ns(se.column("ts")),
                  (f"vbucket {v}: {stream_end_reason_name(r)}" for v, r in
                   zip(se.column("vbucket").to_pylist(), se.column("stream_end_reason").to_pylist())))
        cm = t.filter(pc.and_(pc.starts_with(op, "clustermap").fill_null(False), inbound))
        self.mark("cluster map change", _ns(cm.column("ts")), ("cluster map" for _ in range(cm.num_rows)))

    def _dcp_kinds(self, t: pa.Table, op) -> None:
        snaps = t.filter(pc.equal(op, "snapshot_marker").fill_null(False))
        flags = _int(snaps.column("snap_flags"), 0)
        for f, n in zip(*[a.tolist() for a in np.unique(flags, return_counts=True)]):
            name = "disk" if f & 0x02 else "memory" if f & 0x01 else "other"
            name += "+history" if f & 0x10 else ""
            self.kinds[name] = self.kinds.get(name, 0) + n
        oso = t.filter(pc.and_(pc.equal(op, "oso_snapshot").fill_null(False),
                               pc.equal(pc.bit_wise_and(t.column("snap_flags"), 1), 1).fill_null(False)))
        if oso.num_rows:
            self.kinds["oso"] = self.kinds.get("oso", 0) + oso.num_rows

    def feed_synapse(self, t: pa.Table) -> None:
        ts = _ns(t.column("ts"))
        self.rate(ts, _lengths(t.column("raw")))
        self.reconnects(ts, _int(t.column("conn"), -1))
        cmd = _plain(t.column("command"))
        inbound = pc.equal(t.column("direction"), "in").fill_null(False)
        rdata = t.filter(pc.and_(pc.and_(pc.equal(cmd, "RDATA").fill_null(False), inbound),
                                 pc.is_valid(t.column("token"))))
        streams = [f"{s} / {i}" for s, i in zip(_plain(rdata.column("stream")).fill_null("?").to_pylist(),
                                                 _plain(rdata.column("instance")).fill_null("?").to_pylist())]
        ids = np.array([self.series_names.setdefault(s, len(self.series_names)) for s in streams], np.int64)
        self.progress(ids, _ns(rdata.column("ts")), _int(rdata.column("token"), 0))
        for s, n in zip(*[a.tolist() for a in np.unique(np.array(streams, dtype=object), return_counts=True)]
                        ) if streams else ():
            self.kinds[s] = self.kinds.get(s, 0) + n
        caught = pc.and_(pc.equal(cmd, "RDATA").fill_null(False),
                         pc.equal(t.column("direction"), "catch-up").fill_null(False))
        self.caught_up += pc.sum(pc.cast(caught, "int64")).as_py() or 0
        got = t.filter(pc.and_(inbound, pc.is_valid(cmd)))
        self.count_ops(_plain(got.column("command")).to_pylist(), _ns(got.column("ts")))
        err = t.filter(pc.equal(cmd, "ERROR").fill_null(False))
        self.mark("ERROR", _ns(err.column("ts")), (str(a)[:120] for a in err.column("args").to_pylist()))

    def finish(self, data: ReportData, max_series: int, top_keys: int) -> None:
        data.width_ns = self.width
        data.bins = self.t0 + np.arange(self.nbins, dtype=np.int64) * self.width
        data.frames_per_bin, data.bytes_per_bin = self.frames_per_bin, self.bytes_per_bin
        data.frames, data.bytes = self.frames, self.bytes
        data.marks = {k: [tuple(v[b]) for b in sorted(v)] for k, v in self.marks.items()}
        data.mark_counts, data.kinds = self.mark_counts, self.kinds
        data.caught_up = self.caught_up
        data.ops, data.op_totals = self.ops, self.op_totals
        data.unserved = sorted(self.refused - self.served)
        if self.backfill_span:
            data.backfill = {"items": int(self.backfill.sum()), "first_ns": self.backfill_span[0],
                             "last_ns": self.backfill_span[1], "per_bin": self.backfill}
        data.progress_series = len(self.series_changes)
        busiest = sorted(self.series_changes, key=lambda s: (-self.series_changes[s], s))[:max_series]
        names = {v: k for k, v in self.series_names.items()}
        for sid in sorted(busiest):
            row = self.grid[self.rows[sid]]
            have = row > _LOW
            label = f"vbucket {sid}" if self.protocol == "dcp" else names.get(sid, str(sid))
            data.progress[label] = (data.bins[have], np.maximum.accumulate(row[have]))
        if self.key_parts and top_keys:
            self._compact_keys()
            t = self.key_parts[0].sort_by([("n", "descending"), ("key", "ascending")]).slice(0, top_keys)
            data.top_keys = [(_text(k), c, n) for k, c, n in zip(t.column("key").to_pylist(),
                             t.column("collection_id").to_pylist(), t.column("n").to_pylist())]


_LOW = np.iinfo(np.int64).min


def span(files: list[reader.CaptureFile]) -> tuple[int, int] | None:
    """(first, last) `ts` in ns of the captures, from the `ts` column alone; None when empty."""
    bounds: tuple[int, int] | None = None
    for t in reader.iter_capture_tables(files, ["ts"]):
        mm = pc.min_max(t.column("ts").cast(pa.int64()))
        if mm["min"].is_valid:
            a, b = mm["min"].as_py(), mm["max"].as_py()
            bounds = (a, b) if bounds is None else (min(bounds[0], a), max(bounds[1], b))
    return bounds


def _plain(col):
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col


def _ns(col) -> np.ndarray:
    return pc.fill_null(col.cast(pa.int64()), 0).to_numpy()


def _int(col, fill: int) -> np.ndarray:
    return pc.fill_null(col.cast(pa.int64()), fill).to_numpy()


def _lengths(col) -> np.ndarray:
    return pc.fill_null(pc.binary_length(col).cast(pa.int64()), 0).to_numpy()


def _text(key: bytes | None) -> str:
    if key is None:
        return "(no key)"
    return key.decode("utf-8", "backslashreplace")


def segments(files: list[reader.CaptureFile]) -> list[Segment]:
    out = []
    for f in files:
        rows = None if f.in_progress else pq.ParquetFile(arrow_source(f.path)).metadata.num_rows
        out.append(Segment(os.path.basename(f.path), os.path.getsize(f.path), rows))
    return out


def collect(files: list[reader.CaptureFile], *, max_points: int = 2000, max_series: int = 32,
            top_keys: int = 20, batch_rows: int = 1 << 18) -> ReportData:
    """Aggregate the captures `files` (one protocol): at most `max_points` time bins."""
    protocol = reader.protocol_of(files)
    data = ReportData(protocol=protocol, segments=segments(files))
    t0, t1 = span(files) or (0, 0)
    width = max(MIN_BIN_NS, -(-(t1 - t0 + 1) // max_points))
    data.t0_ns, data.t1_ns = t0, t1
    acc = _Acc(protocol, t0, width, int((t1 - t0) // width) + 1)
    cols, feed = (DCP_COLUMNS, acc.feed_dcp) if protocol == "dcp" else (SYNAPSE_COLUMNS, acc.feed_synapse)
    for t in reader.iter_capture_tables(files, cols, batch_rows=batch_rows):
        if t.num_rows:
            feed(t)
    acc.finish(data, max_series, top_keys)
    lag = lag_table(files)
    if lag is not None:
        data.lag = lag_by_node(lag, t0, width, acc.nbins, max_series)
    if data.frames:
        from dcptool.replay.check.report_tables import numbers
        data.tables = numbers(files)
    return data


LAG_COLUMNS = ["ts", "node", "vbucket", "high_seqno", "seqno", "lag_items"]


def lag_table(files: list[reader.CaptureFile]) -> pa.Table | None:
    """The replay's `lag` table of DCP captures (its LAG_COLUMNS), or None while the replay
    has no such table (issue 26 adds it) or it lacks one of them."""
    if reader.protocol_of(files) != "dcp":
        return None
    if "lag" not in T.table_specs("dcp"):
        return None
    t = replay_local(files, tables=["lag"]).table("lag")
    return t.select(LAG_COLUMNS) if set(LAG_COLUMNS) <= set(t.column_names) else None


def lag_by_node(t: pa.Table, t0: int, width: int, nbins: int, max_series: int) -> dict:
    """node -> (bin start ns, highest lag_items of its vbuckets in the bin), the bins with a
    row only; the `max_series` nodes with the most rows."""
    if not t.num_rows:
        return {}
    ts = _ns(t.column("ts"))
    lag = _int(t.column("lag_items"), 0)
    nodes = np.array([str(n) if n is not None else "?" for n in t.column("node").to_pylist()], dtype=object)
    b = np.clip((ts - t0) // max(1, width), 0, nbins - 1)
    names, counts = np.unique(nodes, return_counts=True)
    keep = sorted(names[np.argsort(-counts, kind="stable")][:max_series])
    out = {}
    for name in keep:
        mine = nodes == name
        grid = np.full(nbins, -1, np.int64)
        np.maximum.at(grid, b[mine], lag[mine])
        have = grid >= 0
        out[name] = (t0 + np.flatnonzero(have).astype(np.int64) * width, grid[have])
    return out
