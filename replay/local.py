"""The reference engine: REPLAY.md as columnar passes with pyarrow and numpy.

Every rule of REPLAY.md is one short block below, named after it. The functions that hold
the semantics (`DcpState`, `synapse_tables`) take frames of any set of vbuckets (or
Synapse streams) and are what the Spark engine runs per group, so both engines share them.

Frame order is carried by `_seq`, any int64 below 2**44 that grows with (started_at of the
capture, capture_id, frame_no): the local engine uses the row's position in the ordered
captures, Spark ranks rows inside a group. Connections are told apart by `_conn`
(capture rank << 32 | conn): a reconnect is a change of `_conn`.

DCP state is built in one pass over the frames in order, so that memory grows with
documents, not frames. Rollbacks are the one rule that looks ahead (a rollback undoes
changes made before it), so their answers are read first (a pass skipped when the Parquet
statistics show none). Each chunk is prepared on a worker thread (DcpState.prepare: the
work that needs no state) and applied in order on the main one (DcpState.apply); documents
keep each one's last change, merged from per-chunk changes in the background.
"""

from __future__ import annotations

import collections
import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay import reader, tables as T
from dcptool.replay.schema import capture_schema

SEQ_BITS = 44
STATUS_SUCCESS = 0x00
STATUS_ROLLBACK = 0x23
DOC_STATES = {"mutation": "live", "deletion": "deleted", "expiration": "expired"}
# ops that belong to a vbucket's stream; `in` frames with these ops and a vbucket are the
# "vbucket frames" the DCP state is built from
VB_OPS = ("stream_req", "get_failover_log", "stream_end", "snapshot_marker", "mutation",
          "deletion", "expiration", "seqno_advanced", "system_event", "oso_snapshot", "prepare",
          "commit", "abort")

DCP_FILTER_COLUMNS = ["direction", "vbucket", "op", "decode_error"]
DCP_STATE_COLUMNS = ["capture_id", "frame_no", "ts", "vbucket", "op", "status", "cas", "datatype",
                     "collection_id", "key", "value_len", "by_seqno", "rev_seqno", "item_flags",
                     "expiration", "snap_version", "snap_start", "snap_end", "snap_flags",
                     "stream_end_reason", "rollback_seqno", "failover_log"]
DCP_ROLLBACK_COLUMNS = ["capture_id", "frame_no", "ts", "vbucket", "op", "status", "rollback_seqno"]
SYN_GROUP_COMMANDS = ("RDATA", "POSITION")
SYN_STATE_COLUMNS = ["capture_id", "frame_no", "ts", "conn", "stream", "instance", "command",
                     "token", "batch", "prev_token", "new_token", "row"]

NONE_TS = np.iinfo(np.int64).max
# rows per chunk of the item pass: small enough to stay in cache and bound memory
# (measured 1M frames: 1M-row chunks 2.2 s / 886 MB, 256k-row chunks 1.5 s / 697 MB)
CHUNK_ROWS = 1 << 18


def _np(col, fill=None, dtype=None) -> np.ndarray:
    """A column as numpy (nulls replaced by `fill`)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if fill is not None and col.null_count:
        col = pc.fill_null(col, fill)
    arr = col.to_numpy(zero_copy_only=False)
    return arr.astype(dtype, copy=False) if dtype is not None else arr


def _str(col) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col.cast(pa.string()) if pa.types.is_dictionary(col.type) else col




def _ts(col) -> np.ndarray:
    return _np(col.cast(pa.int64()) if not isinstance(col, pa.ChunkedArray) else col.cast(pa.int64()),
               fill=NONE_TS, dtype=np.int64)


def _ts_array(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None else ~valid
    return pa.array(values.astype(np.int64), pa.int64(), mask=mask).cast(T.TS)


# ---------------------------------------------------------------------------------------
# DCP

def _codes(col) -> tuple[np.ndarray, list]:
    """A string column as (dictionary codes, -1 for null; the dictionary as a list)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_dictionary(col.type):
        col = pc.dictionary_encode(col)
    return _np(col.indices, fill=-1, dtype=np.int64), col.dictionary.to_pylist()


def _lookup(col, *sets) -> list[np.ndarray]:
    """One mask per set of strings: rows whose value is in the set (null is in none)."""
    codes, words = _codes(col)
    masks = []
    for values in sets:
        lut = np.zeros(len(words) + 1, bool)   # the extra last slot is code -1 (null)
        lut[:len(words)] = [w in values for w in words]
        masks.append(lut[codes])
    return masks


def _is(col, value) -> np.ndarray:
    return _lookup(col, {value})[0]


def _is_in(col, values) -> np.ndarray:
    return _lookup(col, set(values))[0]


def dcp_vbucket_frames(t: pa.Table) -> np.ndarray:
    """Mask of the vbucket frames: `in`, with a vbucket, decoded, op of a vbucket stream."""
    return (_is(t.column("direction"), "in") & _is_in(t.column("op"), VB_OPS) & _np(t.column("vbucket").is_valid(), dtype=bool)
            & _np(t.column("decode_error").is_null(), dtype=bool))


def rollback_mask(t: pa.Table) -> np.ndarray:
    """Mask of the ROLLBACK answers to stream requests (with the seqno to roll back to)."""
    return (_is(t.column("op"), "stream_req") & (_np(t.column("status"), fill=0xFFFF, dtype=np.int64) == STATUS_ROLLBACK)
            & _np(t.column("rollback_seqno").is_valid(), dtype=bool))


def _ck(t: pa.Table) -> np.ndarray:
    """(vbucket, frame order) as one sortable int64."""
    return (_np(t.column("vbucket"), dtype=np.int64) << SEQ_BITS) | _np(t.column("_seq"), dtype=np.int64)


class _Grow:
    """numpy arrays that grow at the end (amortised). Attributes are the whole arrays, to
    read and write in place by index; `view(name)` is the filled part."""

    def __init__(self, **fills):
        self.n = 0
        self._fills = fills
        self._a = {k: np.full(16, fill, dtype) for k, (dtype, fill) in fills.items()}

    def extend(self, count: int, **values) -> None:
        need = self.n + count
        cap = len(next(iter(self._a.values())))
        if need > cap:
            for k, (dtype, fill) in self._fills.items():
                a = np.full(max(need, 2 * cap), fill, dtype)
                a[:self.n] = self._a[k][:self.n]
                self._a[k] = a
        for k, v in values.items():
            self._a[k][self.n:need] = v
        self.n = need

    def __getattr__(self, name):
        try:
            return self.__dict__["_a"][name]
        except KeyError:
            raise AttributeError(name) from None

    def view(self, name) -> np.ndarray:
        return self._a[name][:self.n]


MARKER_COLUMNS = ["vbucket", "capture_id", "frame_no", "ts", "snap_version", "snap_start", "snap_end",
                  "snap_flags", "_seq"]
DOC_COLUMNS = ["vbucket", "collection_id", "key", "by_seqno", "rev_seqno", "cas", "op", "datatype",
               "item_flags", "expiration", "value_len", "capture_id", "frame_no", "ts"]
INT64_MIN = np.iinfo(np.int64).min


class _Prepared:
    """What `DcpState.prepare` found in a chunk, for `DcpState.apply`."""


class DcpState:
    """Replays the DCP rules of REPLAY.md over vbucket frames, in one pass.

    `rollbacks` holds the ROLLBACK answers (`rollback_mask`) of every vbucket that will be
    fed: they are the only rule that looks ahead (a rollback undoes changes made before it).
    `feed` takes the vbucket frames in frame order, in chunks of any size; the state it keeps
    grows with documents, snapshots and vbuckets, not with frames."""

    def __init__(self, rollbacks: pa.Table, merger: ThreadPoolExecutor | None = None):
        # `merger`, when given, merges document changes in the background (one at a time)
        self._merger = merger
        self._merging = None                  # the merge running there, if any
        self._docs_rows = 0                   # documents after the last merge that finished
        # a ROLLBACK response to a stream request rolls the vbucket back to rollback_seqno
        self.rollbacks = rollbacks.take(np.argsort(_ck(rollbacks), kind="stable"))
        self.r_vb = _np(self.rollbacks.column("vbucket"), dtype=np.int64)
        self.r_seq = _np(self.rollbacks.column("_seq"), dtype=np.int64)
        self.r_seqno = _np(self.rollbacks.column("rollback_seqno"), dtype=np.int64)
        self.undone = np.zeros(len(self.r_vb), np.int64)

        size = 1 << 16
        self.seen = np.zeros(size, bool)
        self.first_ts = np.full(size, NONE_TS, np.int64)
        self.last_ts = np.full(size, INT64_MIN, np.int64)
        self.counts = {op_: np.zeros(size, np.int64) for op_ in DOC_STATES}
        self.high_seqno = np.full(size, -1, np.int64)
        self.has_high = np.zeros(size, bool)
        # snapshots: the marker each vbucket is in (-1: none, or closed by a stream end)
        self.current = np.full(size, -1, np.int64)
        self.snaps = _Grow(vb=(np.int64, 0), seq=(np.int64, 0), end=(np.int64, -1), items=(np.int64, 0),
                           hit_end=(bool, False), first_seqno=(np.int64, 0), has_first=(bool, False),
                           last_seqno=(np.int64, 0))
        self._markers: list[pa.Table] = []
        self._failover: list[pa.Table] = []   # stream-request successes with a failover log
        self._ends: list[pa.Table] = []       # stream ends
        self.docs: pa.Table | None = None     # the last surviving change per document so far
        self._parts: list[pa.Table] = []      # newer per-chunk changes not merged into docs yet
        self._parts_rows = 0
        self._dedupe_chunks, self._not_deduped = True, 0

    def feed(self, chunk: pa.Table) -> None:
        """Apply the next vbucket frames (in frame order)."""
        self.apply(self.prepare(chunk))

    def prepare(self, chunk: pa.Table) -> "_Prepared | None":
        """The work on a chunk that needs no state but the rollbacks: safe to run on another
        thread while `apply` takes the previous chunk."""
        n = chunk.num_rows
        if n == 0:
            return None
        p = _Prepared()
        vb = _np(chunk.column("vbucket"), dtype=np.int64)
        seq = _np(chunk.column("_seq"), dtype=np.int64)
        ts = _ts(chunk.column("ts"))
        is_mut, is_del, is_exp, is_adv, is_marker, is_end, is_req = _lookup(
            chunk.column("op"), {"mutation"}, {"deletion"}, {"expiration"}, {"seqno_advanced"},
            {"snapshot_marker"}, {"stream_end"}, {"stream_req"})

        # per-vbucket activity and counters
        p.seen = np.bincount(vb, minlength=1 << 16) > 0
        p.first_ts = np.full(1 << 16, NONE_TS, np.int64)
        np.minimum.at(p.first_ts, vb, ts)
        p.last_ts = np.full(1 << 16, INT64_MIN, np.int64)
        np.maximum.at(p.last_ts, vb, np.where(ts == NONE_TS, INT64_MIN, ts))
        p.counts = {name: np.bincount(vb[m], minlength=1 << 16)
                    for name, m in (("mutation", is_mut), ("deletion", is_del), ("expiration", is_exp))}
        is_change = is_mut | is_del | is_exp
        seqno = _np(chunk.column("by_seqno"), fill=-1, dtype=np.int64)

        # a stream-request success sets the vbucket's failover log, a stream end its reason
        # (the last one wins)
        ok = is_req & (_np(chunk.column("status"), fill=0xFFFF, dtype=np.int64) == STATUS_SUCCESS)
        ok &= _np(chunk.column("failover_log").is_valid(), dtype=bool)
        p.failover = chunk.select(["vbucket", "failover_log", "_seq"]).filter(pa.array(ok)) if ok.any() else None
        p.ends = (chunk.select(["vbucket", "stream_end_reason", "_seq"]).filter(pa.array(is_end))
                  if is_end.any() else None)

        # rollback: a change with by_seqno above rollback_seqno, made before the rollback and
        # not already undone, is undone by it
        undone_by = self._undone_by(vb, seq, seqno, is_change | is_adv)
        counted = undone_by[is_change & (undone_by >= 0)]
        p.undone = np.bincount(counted, minlength=len(self.r_vb)) if len(counted) else None
        alive = undone_by < 0

        # high_seqno: the highest seqno not undone (items and seqno-advanced)
        hi = (is_change | is_adv) & alive
        p.high = np.full(1 << 16, -1, np.int64)
        np.maximum.at(p.high, vb[hi], seqno[hi])
        p.has_high = np.bincount(vb[hi], minlength=1 << 16) > 0

        self._prepare_snapshots(p, chunk, vb, seq, seqno, is_marker, is_end, is_change, is_adv)

        # mutation, deletion, expiration: the document takes the change; the later frame wins
        keep = np.flatnonzero(is_change & alive)
        p.part = None
        if len(keep):
            # a chunk's own earlier changes of a document are dropped here, when that pays:
            # with far more documents than a chunk holds, the merge alone is cheaper (either
            # way the merge gives the same documents, so threads racing on the flag are harmless)
            if self._dedupe_chunks:
                rows = _last_per_document_rows(chunk, keep)
                if len(keep) >= 1 << 16:    # small chunks tell nothing
                    self._dedupe_chunks = len(rows) < 0.75 * len(keep)
            else:
                rows = keep
                self._not_deduped += 1
                self._dedupe_chunks = self._not_deduped % 8 == 0   # look again now and then
            rows = rows[np.argsort(vb[rows].astype(np.uint16), kind="stable")]   # by (vbucket, frame order)
            part = chunk.select(DOC_COLUMNS).take(rows)
            part = part.set_column(DOC_COLUMNS.index("op"), "op", _str(part.column("op")))
            p.part = part.set_column(DOC_COLUMNS.index("capture_id"), "capture_id",
                                     _str(part.column("capture_id")))
        return p

    def apply(self, p: "_Prepared | None") -> None:
        if p is None:
            return
        self.seen |= p.seen
        np.minimum(self.first_ts, p.first_ts, out=self.first_ts)
        np.maximum(self.last_ts, p.last_ts, out=self.last_ts)
        for name, c in p.counts.items():
            self.counts[name] += c
        if p.failover is not None:
            self._failover.append(p.failover)
        if p.ends is not None:
            self._ends.append(p.ends)
        if p.undone is not None:
            self.undone += p.undone
        np.maximum(self.high_seqno, p.high, out=self.high_seqno)
        self.has_high |= p.has_high
        self._apply_snapshots(p)
        if p.part is not None:
            self._parts.append(p.part)
            self._parts_rows += p.part.num_rows
            # merge once the pending changes are twice the documents: amortised linear
            if self._parts_rows >= max(CHUNK_ROWS, 2 * self._docs_rows):
                self._merge_docs(background=self._merger is not None)

    def _undone_by(self, vb, seq, seqno, candidates) -> np.ndarray:
        """For each row, the rollback that undoes it (index into self.rollbacks), or -1."""
        undone_by = np.full(len(vb), -1, np.int64)
        later = np.flatnonzero(self.r_seq > seq[0])   # rollbacks that can undo rows of this chunk
        if len(later) == 0:
            return undone_by
        rows = np.flatnonzero(candidates)
        rows = rows[np.argsort(vb[rows].astype(np.uint16), kind="stable")]   # by (vbucket, frame order)
        c_vb, c_seq, c_seqno = vb[rows], seq[rows], seqno[rows]
        by = np.full(len(rows), -1, np.int64)
        for r in later:          # in (vbucket, frame order): an earlier rollback counts first
            lo, hi = np.searchsorted(c_vb, [self.r_vb[r], self.r_vb[r] + 1])
            seg = by[lo:hi]
            seg[(c_seq[lo:hi] < self.r_seq[r]) & (c_seqno[lo:hi] > self.r_seqno[r]) & (seg < 0)] = r
        undone_by[rows] = by
        return undone_by

    @staticmethod
    def _prepare_snapshots(p, chunk, vb, seq, seqno, is_marker, is_end, is_change, is_adv) -> None:
        """A snapshot marker opens a snapshot; its items follow until the next marker or a
        stream end. Here: each row's closer within the chunk (markers numbered from 0)."""
        mk = np.flatnonzero(is_marker)
        p.markers = chunk.select(MARKER_COLUMNS).take(mk) if len(mk) else None
        p.m_vb, p.m_seq = vb[mk], seq[mk]
        p.m_end = _np(chunk.column("snap_end").take(mk), fill=-1, dtype=np.int64)
        rows = np.flatnonzero(is_marker | is_end | is_change | is_adv)
        rows = rows[np.argsort(vb[rows].astype(np.uint16), kind="stable")]   # by (vbucket, frame order)
        p.rvb = rvb = vb[rows]
        # what each row is: a marker (its number), a stream end (-1) or an item (-2)
        what = np.full(len(vb), -2, np.int64)
        what[mk] = np.arange(len(mk))
        what[is_end] = -1
        w = what[rows]
        pos = np.arange(len(rows))
        last_closer = np.maximum.accumulate(np.where(w != -2, pos, -1)) if len(rows) else pos
        start = np.ones(len(rows), bool)
        start[1:] = rvb[1:] != rvb[:-1]
        run_start = np.maximum.accumulate(np.where(start, pos, 0)) if len(rows) else pos
        p.inherited = last_closer < run_start      # no closer of its vbucket yet in this chunk
        p.closer = w[np.maximum(last_closer, 0)] if len(rows) else w
        p.run_end = np.append(np.flatnonzero(start)[1:], len(rows)) - 1 if len(rows) else pos
        p.is_item = w == -2
        p.r_seqno = seqno[rows]
        p.r_change = is_change[rows]

    def _apply_snapshots(self, p) -> None:
        s = self.snaps
        base = s.n
        if p.markers is not None:
            self._markers.append(p.markers)
            s.extend(len(p.m_vb), vb=p.m_vb, seq=p.m_seq, end=p.m_end)
        if len(p.rvb) == 0:
            return
        mi = np.where(p.inherited, self.current[p.rvb], np.where(p.closer >= 0, p.closer + base, -1))
        self.current[p.rvb[p.run_end]] = mi[p.run_end]
        inside = p.is_item & (mi >= 0)
        hit = inside & (p.r_seqno == s.end[np.maximum(mi, 0)])
        s.hit_end[mi[hit]] = True
        item = inside & p.r_change
        imi, iseq = mi[item], p.r_seqno[item]   # a marker's items are consecutive here
        if len(imi) == 0:
            return
        np.add.at(s.items, imi, 1)
        change = np.flatnonzero(imi[1:] != imi[:-1])
        first_i = np.concatenate([[0], change + 1])
        last_i = np.append(change, len(imi) - 1)
        fm = imi[first_i]
        new = ~s.has_first[fm]
        s.first_seqno[fm[new]] = iseq[first_i][new]
        s.has_first[fm] = True
        s.last_seqno[imi[last_i]] = iseq[last_i]

    def _merge_docs(self, background: bool = False) -> None:
        if self._merging is not None:         # merges chain: the next one starts from its result
            self.docs, self._merging = self._merging.result(), None
            self._docs_rows = self.docs.num_rows
        if self._parts:
            tables = ([self.docs] if self.docs is not None else []) + self._parts
            # each table is by (vbucket, frame order) and newer than the one before it
            self._parts, self._parts_rows = [], 0
            if background:
                self._merging = self._merger.submit(_last_per_document, pa.concat_tables(tables))
            else:
                self.docs = _last_per_document(pa.concat_tables(tables))
                self._docs_rows = self.docs.num_rows

    def finish(self) -> dict[str, pa.Table]:
        out: dict[str, pa.Table] = {}
        # documents
        self._merge_docs()
        if self.docs is None:
            docs = T.DCP_TABLES["documents"][0].empty_table()
        else:
            d = self.docs
            op = d.column("op")
            state = pc.if_else(pc.equal(op, "mutation"), "live",
                               pc.if_else(pc.equal(op, "deletion"), "deleted", "expired"))
            d = d.set_column(d.column_names.index("op"), "state", state)
            docs = T.canonical("dcp", "documents", d)
        out["documents"] = docs

        # snapshots, by (vbucket, frame order): complete by an item at snap_end, or the next
        # marker of the vbucket starting above it
        s = self.snaps
        order = np.lexsort((s.view("seq"), s.view("vb")))
        m = (pa.concat_tables(self._markers) if self._markers
             else pa.schema([capture_schema("dcp").field(c) for c in MARKER_COLUMNS[:-1]]
                            + [("_seq", pa.int64())]).empty_table()).take(order)
        m_vb = s.view("vb")[order]
        m_start = _np(m.column("snap_start"), fill=-1, dtype=np.int64)
        m_end = s.view("end")[order]
        items = s.view("items")[order]
        nm = len(m_vb)
        nxt_above = np.zeros(nm, bool)
        if nm > 1:
            same = m_vb[1:] == m_vb[:-1]
            nxt_above[:-1] = same & (m_start[1:] > m_end[:-1])
        complete = s.view("hit_end")[order] | nxt_above
        has_items = items > 0
        out["snapshots"] = T.canonical("dcp", "snapshots", pa.table({
            "vbucket": m.column("vbucket"), "capture_id": _str(m.column("capture_id")),
            "frame_no": m.column("frame_no"), "ts": m.column("ts"),
            "snap_version": _str(m.column("snap_version")), "snap_start": m.column("snap_start"),
            "snap_end": m.column("snap_end"), "snap_flags": m.column("snap_flags"),
            "items": pa.array(items, pa.int64()),
            "first_seqno": pa.array(s.view("first_seqno")[order], pa.int64(), mask=~has_items),
            "last_seqno": pa.array(s.view("last_seqno")[order], pa.int64(), mask=~has_items),
            "complete": pa.array(complete, pa.bool_())}))

        r = self.rollbacks
        out["rollbacks"] = T.canonical("dcp", "rollbacks", pa.table({
            "vbucket": r.column("vbucket"), "capture_id": _str(r.column("capture_id")),
            "frame_no": r.column("frame_no"), "ts": r.column("ts"),
            "rollback_seqno": r.column("rollback_seqno"), "undone": pa.array(self.undone, pa.int64())}))

        # failover: the newest failover log, position 0 = newest entry as on the wire
        fo_type = capture_schema("dcp").field("failover_log").type
        f = _last_per_vbucket(pa.concat_tables(self._failover) if self._failover else pa.schema(
            [("vbucket", pa.uint16()), ("failover_log", fo_type), ("_seq", pa.int64())]).empty_table())
        fl = f.column("failover_log").combine_chunks() if f.num_rows else pa.array([], fo_type)
        lens = _np(pc.list_value_length(fl), fill=0, dtype=np.int64) if len(fl) else np.zeros(0, np.int64)
        flat = pc.list_flatten(fl) if len(fl) else pa.array([], fl.type.value_type)
        vbs = np.repeat(_np(f.column("vbucket"), dtype=np.int64), lens) if f.num_rows else np.zeros(0, np.int64)
        pos = (np.arange(len(vbs)) - np.repeat(np.cumsum(lens) - lens, lens)) if len(vbs) else np.zeros(0, np.int64)
        out["failover"] = T.canonical("dcp", "failover", pa.table({
            "vbucket": pa.array(vbs, pa.uint16()), "position": pa.array(pos, pa.int32()),
            "vbucket_uuid": flat.field("vbucket_uuid"), "seqno": flat.field("seqno")}))

        # vbuckets
        vbs = np.flatnonzero(self.seen)
        nv = len(vbs)
        at = np.full(1 << 16, -1, np.int64)
        at[vbs] = np.arange(nv)

        def per_vbucket(vb_of_rows: np.ndarray, values: list, typ: pa.DataType) -> pa.Array:
            """The value of the last row of each vbucket (rows in frame order)."""
            vals = [None] * nv
            for v, x in zip(vb_of_rows.tolist(), values):
                if at[v] >= 0:
                    vals[at[v]] = x
            return pa.array(vals, typ)

        dvb = _np(docs.column("vbucket"), dtype=np.int64)
        live_, deleted_, expired_ = _lookup(docs.column("state"), {"live"}, {"deleted"}, {"expired"})
        heads = [lst[0]["vbucket_uuid"] if lst else None for lst in fl.to_pylist()] if f.num_rows else []
        ends = _last_per_vbucket(pa.concat_tables(self._ends)) if self._ends else None
        has_high = self.has_high[vbs]
        out["vbuckets"] = T.canonical("dcp", "vbuckets", pa.table({
            "vbucket": pa.array(vbs, pa.uint16()),
            "vbucket_uuid": per_vbucket(_np(f.column("vbucket"), dtype=np.int64) if f.num_rows
                                        else np.zeros(0, np.int64), heads, pa.uint64()),
            "high_seqno": pa.array(self.high_seqno[vbs], pa.int64(), mask=~has_high),
            "live": pa.array(np.bincount(dvb[live_], minlength=1 << 16)[vbs], pa.int64()),
            "deleted": pa.array(np.bincount(dvb[deleted_], minlength=1 << 16)[vbs], pa.int64()),
            "expired": pa.array(np.bincount(dvb[expired_], minlength=1 << 16)[vbs], pa.int64()),
            "mutations": pa.array(self.counts["mutation"][vbs], pa.int64()),
            "deletions": pa.array(self.counts["deletion"][vbs], pa.int64()),
            "expirations": pa.array(self.counts["expiration"][vbs], pa.int64()),
            "snapshots": pa.array(np.bincount(m_vb, minlength=1 << 16)[vbs], pa.int64()),
            "rollbacks": pa.array(np.bincount(self.r_vb, minlength=1 << 16)[vbs], pa.int64()),
            "last_snapshot_complete": per_vbucket(m_vb, complete.tolist(), pa.bool_()),
            "stream_end_reason": (per_vbucket(_np(ends.column("vbucket"), dtype=np.int64),
                                              ends.column("stream_end_reason").to_pylist(), pa.uint32())
                                  if ends is not None else pa.nulls(nv, pa.uint32())),
            "first_ts": _ts_array(self.first_ts[vbs], self.first_ts[vbs] != NONE_TS),
            "last_ts": _ts_array(self.last_ts[vbs], self.last_ts[vbs] != INT64_MIN)}))
        return out


def _last_per_vbucket(t: pa.Table) -> pa.Table:
    """The last row (by _seq) of each vbucket."""
    if t.num_rows == 0:
        return t
    t = t.take(np.argsort(_np(t.column("_seq"), dtype=np.int64), kind="stable"))
    last = np.full(1 << 16, -1, np.int64)
    np.maximum.at(last, _np(t.column("vbucket"), dtype=np.int64), np.arange(t.num_rows))
    return t.take(np.sort(last[last >= 0]))


# keys are hashed in groups of whole vbuckets about this big: a hash table that fits in
# cache is several times faster than one over every document (measured 1.9M keys: 252 ms
# in one table)
KEY_GROUP_ROWS = 1 << 16


def _key_codes(t: pa.Table, rows: np.ndarray, vb: np.ndarray,
               order: np.ndarray | None) -> tuple[np.ndarray, int]:
    """A code per row of `rows`: rows of the same vbucket have the same code exactly when
    they have the same key (null included). Returns the codes and their upper bound.
    `order` (rows by vbucket), when given, has the keys hashed a group of vbuckets at a time."""
    if order is None or len(rows) <= 4 * KEY_GROUP_ROWS:
        enc = pc.dictionary_encode(t.column("key"))   # the other rows' keys are null: cheap
        if isinstance(enc, pa.ChunkedArray):
            enc = enc.combine_chunks()
        n = len(enc.dictionary) + 1                    # + one code for a null key
        return _np(enc.indices, fill=n - 1, dtype=np.int64)[rows], n
    keys = t.column("key").take(rows[order])
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    starts = np.flatnonzero(np.diff(vb[order])) + 1      # where a vbucket begins
    cut = np.searchsorted(starts, np.arange(KEY_GROUP_ROWS, len(rows), KEY_GROUP_ROWS))
    bounds = np.concatenate([[0], np.unique(starts[cut[cut < len(starts)]]), [len(rows)]])
    codes = np.empty(len(rows), np.int64)
    base = 0
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        enc = pc.dictionary_encode(keys.slice(lo, hi - lo))
        n = len(enc.dictionary) + 1
        codes[order[lo:hi]] = _np(enc.indices, fill=n - 1, dtype=np.int64) + base
        base += n
    return codes, base


def _last_per_document_rows(t: pa.Table, rows: np.ndarray, by_vbucket: bool = False) -> np.ndarray:
    """Of `rows` (frame order within each vbucket), those that are the last change of their
    document (vbucket, collection_id, key): in the order of `rows`, or with `by_vbucket` by
    (vbucket, order in `rows`)."""
    vb = _np(t.column("vbucket"), dtype=np.int64)[rows]
    order = (np.argsort(vb.astype(np.uint16), kind="stable")
             if by_vbucket or len(rows) > 2 * KEY_GROUP_ROWS else None)
    key, nkeys = _key_codes(t, rows, vb, order)
    cid = t.column("collection_id")
    cid = np.where(_np(cid.is_valid(), dtype=bool), _np(cid, fill=0, dtype=np.int64) + 1, 0)[rows]
    owner = (cid << 16) | vb
    # a key almost always lives in one (vbucket, collection): then the key's code is the document
    seen = np.full(nkeys, -1, np.int64)
    seen[key] = owner
    if (seen[key] == owner).all():
        doc, ndocs = key, nkeys
    else:
        _, owner_code = np.unique(owner, return_inverse=True)
        _, doc = np.unique(key * (int(owner_code.max()) + 1) + owner_code, return_inverse=True)
        ndocs = int(doc.max()) + 1
    last = np.full(ndocs, -1, np.int64)
    np.maximum.at(last, doc, np.arange(len(rows)))
    if not by_vbucket:
        return rows[np.sort(last[last >= 0])]
    is_last = np.zeros(len(rows), bool)
    is_last[last[last >= 0]] = True
    return rows[order[is_last[order]]]


def _last_per_document(t: pa.Table) -> pa.Table:
    """The last row of each (vbucket, collection_id, key), rows of a vbucket being in frame
    order; the result is by (vbucket, frame order)."""
    if t.num_rows == 0:
        return t
    return t.take(_last_per_document_rows(t, np.arange(t.num_rows), by_vbucket=True))


def dcp_group_tables(frames: pa.Table) -> dict[str, pa.Table]:
    """All DCP tables (but `frames`) for vbucket frames held in memory (any order)."""
    seq = _np(frames.column("_seq"), dtype=np.int64)
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():
        frames = frames.take(np.argsort(seq, kind="stable"))
    state = DcpState(frames.filter(pa.array(rollback_mask(frames))))
    state.feed(frames)
    return state.finish()


# ---------------------------------------------------------------------------------------
# Synapse

def synapse_group_frames(t: pa.Table) -> np.ndarray:
    """Mask of the frames that move a (stream, instance): `in` RDATA and POSITION."""
    return (_is(t.column("direction"), "in") & _np(t.column("stream").is_valid(), dtype=bool)
            & _np(t.column("decode_error").is_null(), dtype=bool)
            & _is_in(t.column("command"), SYN_GROUP_COMMANDS))


def synapse_tables(t: pa.Table, max_conn: int) -> dict[str, pa.Table]:
    """`positions`, `rows` and `gaps` for the group frames in `t` (any order; columns
    SYN_STATE_COLUMNS + _seq + _conn). `max_conn` is the highest `_conn` of the whole
    replay: rows still waiting on an older connection were dropped by a reconnect."""
    n = t.num_rows
    stream, instance = _str(t.column("stream")), _str(t.column("instance"))
    s_codes = _np(pc.dictionary_encode(stream, null_encoding="encode").indices, dtype=np.int64)
    i_enc = pc.dictionary_encode(instance, null_encoding="encode")
    i_codes = _np(i_enc.indices, dtype=np.int64)
    gcode = s_codes * (len(i_enc.dictionary) + 1) + i_codes
    order = np.lexsort((_np(t.column("_seq"), dtype=np.int64), gcode))
    t = t.take(order)
    gcode = gcode[order]
    start = np.ones(n, bool)
    start[1:] = gcode[1:] != gcode[:-1]
    gid = np.cumsum(start) - 1
    ng = int(gid[-1]) + 1 if n else 0
    idx = np.arange(n)
    conn = _np(t.column("_conn"), dtype=np.int64)
    cmd = t.column("command")
    is_rdata, is_pos = _is(cmd, "RDATA"), _is(cmd, "POSITION")
    token_valid = _np(t.column("token").is_valid(), dtype=bool)
    token = _np(t.column("token"), fill=0, dtype=np.int64)
    is_batch = is_rdata & (_np(t.column("batch"), fill=False, dtype=bool) | ~token_valid)
    is_num = is_rdata & ~is_batch

    # the batch token rule: waiting rows commit at the next numeric RDATA of the group,
    # unless a reconnect came first (then they are dropped)
    nxt = np.where(is_num, idx, n)
    nxt = np.minimum.accumulate(nxt[::-1])[::-1] if n else nxt
    nn = np.minimum(nxt, max(n - 1, 0))
    joins = is_batch & (nxt < n) & (gid[nn] == gid) & (conn[nn] == conn)
    committed = is_num | joins
    commit_token = np.where(is_num, token, token[nn])
    left = is_batch & ~joins
    dropped = left & (conn < max_conn)
    pending = left & ~dropped

    # rows: index = order of commit among the rows of the same token
    ci = np.flatnonzero(committed)
    ci = ci[np.lexsort((ci, commit_token[ci], gid[ci]))]
    run = np.ones(len(ci), bool)
    run[1:] = (gid[ci][1:] != gid[ci][:-1]) | (commit_token[ci][1:] != commit_token[ci][:-1])
    run_start = np.maximum.accumulate(np.where(run, np.arange(len(ci)), 0)) if len(ci) else np.zeros(0, np.int64)
    index = np.arange(len(ci)) - run_start
    rows = pa.table({
        "stream": stream.take(order).take(ci), "instance": instance.take(order).take(ci),
        "token": pa.array(commit_token[ci], pa.int64()), "index": pa.array(index, pa.int64()),
        "row": t.column("row").take(ci), "capture_id": _str(t.column("capture_id")).take(ci),
        "frame_no": t.column("frame_no").take(ci), "ts": t.column("ts").take(ci)})

    # POSITION prev new: a gap when the last token is below prev; then the token is new
    pos_val = pc.coalesce(t.column("new_token"), t.column("token"))
    setter = is_num | (is_pos & _np(pos_val.is_valid(), dtype=bool))
    value = np.where(is_num, token, _np(pos_val, fill=0, dtype=np.int64))
    last_set = np.maximum.accumulate(np.where(setter, idx, -1)) if n else np.zeros(0, np.int64)
    before = np.concatenate([[-1], last_set[:-1]]) if n else last_set
    bb = np.maximum(before, 0)
    has_before = (before >= 0) & (gid[bb] == gid)
    prev_valid = _np(t.column("prev_token").is_valid(), dtype=bool)
    prev_tok = _np(t.column("prev_token"), fill=0, dtype=np.int64)
    gap = is_pos & prev_valid & has_before & (value[bb] < prev_tok)
    gi = np.flatnonzero(gap)
    gaps = pa.table({
        "stream": stream.take(order).take(gi), "instance": instance.take(order).take(gi),
        "capture_id": _str(t.column("capture_id")).take(gi), "frame_no": t.column("frame_no").take(gi),
        "ts": t.column("ts").take(gi), "from_token": pa.array(value[bb][gi], pa.int64()),
        "to_token": pa.array(prev_tok[gi], pa.int64())})

    # positions
    gstart = np.flatnonzero(start)
    gend = np.append(gstart[1:], n) - 1
    ls = last_set[gend] if n else np.zeros(0, np.int64)
    has_tok = (ls >= 0) & (gid[np.maximum(ls, 0)] == np.arange(ng)) if n else np.zeros(0, bool)
    batches = np.zeros(ng, np.int64)
    commits_of_batches = np.unique(nxt[joins])
    np.add.at(batches, gid[commits_of_batches], 1)
    ts = _ts(t.column("ts"))
    fts = np.full(ng, NONE_TS, np.int64)
    np.minimum.at(fts, gid, ts)
    lts = np.full(ng, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(lts, gid, np.where(ts == NONE_TS, np.iinfo(np.int64).min, ts))
    positions = pa.table({
        "stream": stream.take(order).take(gstart), "instance": instance.take(order).take(gstart),
        "token": pa.array(value[np.maximum(ls, 0)] if n else np.zeros(0, np.int64), pa.int64(), mask=~has_tok),
        "rows": pa.array(np.bincount(gid[committed], minlength=ng), pa.int64()),
        "batches": pa.array(batches, pa.int64()),
        "gaps": pa.array(np.bincount(gid[gap], minlength=ng), pa.int64()),
        "dropped": pa.array(np.bincount(gid[dropped], minlength=ng), pa.int64()),
        "pending": pa.array(np.bincount(gid[pending], minlength=ng), pa.int64()),
        "first_ts": _ts_array(fts, fts != NONE_TS),
        "last_ts": _ts_array(lts, lts != np.iinfo(np.int64).min)})
    return {"positions": T.canonical("synapse", "positions", positions),
            "rows": T.canonical("synapse", "rows", rows),
            "gaps": T.canonical("synapse", "gaps", gaps)}


def commands_table(t: pa.Table) -> pa.Table:
    """count, first_ts, last_ts per command over every frame (both directions)."""
    t = pa.table({"command": _str(t.column("command")), "ts": t.column("ts")})
    t = t.filter(t.column("command").is_valid())
    agg = t.group_by(["command"], use_threads=False).aggregate(
        [("ts", "count", pc.CountOptions(mode="all")), ("ts", "min"), ("ts", "max")])
    return T.canonical("synapse", "commands", pa.table({
        "command": agg.column("command"), "count": agg.column("ts_count"),
        "first_ts": agg.column("ts_min"), "last_ts": agg.column("ts_max")}))


# ---------------------------------------------------------------------------------------
# the engine: reads captures in order and runs the rules

def _ordered(files, columns: list[str], ranks: dict[str, int],
             batch_rows: int = CHUNK_ROWS) -> Iterator[pa.Table]:
    """Tables of `columns` in frame order, with `_seq` (position in the replay) and
    `_conn` (capture rank << 32 | conn) when `conn` is asked for."""
    pos = 0
    # one thread per Parquet file: the engine's own threads already use the cores
    for t in reader.iter_capture_tables(files, columns, batch_rows=batch_rows, threads=False):
        n = t.num_rows
        t = t.append_column("_seq", pa.array(np.arange(pos, pos + n, dtype=np.int64)))
        pos += n
        if "conn" in columns:
            cid = _str(t.column("capture_id"))
            rank = _np(pc.index_in(cid, value_set=pa.array(list(ranks), pa.string())), fill=0,
                       dtype=np.int64)
            t = t.append_column("_conn", pa.array((rank << 32) | _np(t.column("conn"), fill=0, dtype=np.int64)))
        yield t


@dataclass
class Replay:
    """Result of a replay: canonical pyarrow tables by name (frames read on demand)."""
    protocol: str
    files: list
    results: dict[str, pa.Table]

    def names(self) -> list[str]:
        return T.table_names(self.protocol)

    def table(self, name: str) -> pa.Table:
        if name not in self.results:
            if name != "frames":
                raise KeyError(name)
            self.results[name] = T.canonical(self.protocol, "frames", reader.read_capture_table(self.files))
        return self.results[name]


def replay_local(files: list, chunk_rows: int = CHUNK_ROWS, tables=None) -> Replay:
    """`tables`: the names that will be asked for (None: any); Synapse skips building
    `rows` when it is not among them."""
    protocol = reader.protocol_of(files)
    ranks = reader.capture_ranks(files)
    if protocol == "dcp":
        return Replay(protocol, files, _replay_dcp(files, ranks, chunk_rows))
    return Replay(protocol, files, _replay_synapse(files, ranks, tables, chunk_rows))


def _in_order(work: Callable, items: Iterator, pool: ThreadPoolExecutor, ahead: int = 3) -> Iterator:
    """work(item) for each item, computed on `pool` up to `ahead` items in advance, yielded
    in order. Iterating `items` stays on the caller's thread; pyarrow and numpy release the
    GIL, so the pool's threads use the other cores."""
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _chunks(t: pa.Table, rows: int) -> Iterator[pa.Table]:
    for s in range(0, t.num_rows, rows):
        yield t.slice(s, rows)


def _replay_dcp(files, ranks, chunk_rows) -> dict[str, pa.Table]:
    # the rollbacks first: they are rare, and the Parquet statistics usually tell there are none
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_ROLLBACK_COLUMNS))
    rollbacks = []
    if reader.may_have_values(files, "rollback_seqno"):
        for t in _ordered(files, cols, ranks):
            keep = dcp_vbucket_frames(t) & rollback_mask(t)
            if keep.any():
                rollbacks.append(t.filter(pa.array(keep)).select(DCP_ROLLBACK_COLUMNS + ["_seq"]))
    schema = pa.schema([capture_schema("dcp").field(c) for c in DCP_ROLLBACK_COLUMNS] + [("_seq", pa.int64())])
    rollbacks = pa.concat_tables(rollbacks) if rollbacks else schema.empty_table()

    # then every vbucket frame, in order, chunk by chunk: two threads read row groups and do
    # the stateless part of the work on them (DcpState.prepare) ahead of the stateful part on
    # this thread (DcpState.apply); a third merges document changes in the background
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_STATE_COLUMNS))

    def parts():
        pos = 0
        for rows, read in reader.iter_capture_parts(files, cols, batch_rows=chunk_rows):
            yield pos, read
            pos += rows

    def prepare(chunk: pa.Table):
        keep = dcp_vbucket_frames(chunk)
        if not keep.all():
            chunk = chunk.filter(pa.array(keep))
        return state.prepare(chunk.select(DCP_STATE_COLUMNS + ["_seq"]))

    def read(part) -> list:
        """Reads a part (a row group) and queues each of its chunks for `prepare`."""
        pos, read_part = part
        futures = []
        for t in read_part():
            t = t.append_column("_seq", pa.array(np.arange(pos, pos + t.num_rows, dtype=np.int64)))
            pos += t.num_rows
            futures.extend(pool.submit(prepare, c) for c in _chunks(t, chunk_rows))
        return futures

    with ThreadPoolExecutor(2, thread_name_prefix="dcptool-replay") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="dcptool-merge") as merger:
        state = DcpState(rollbacks, merger)
        try:
            for futures in _in_order(read, parts(), pool, ahead=1):
                for f in futures:
                    state.apply(f.result())
        except BaseException:   # an unreadable file, Ctrl-C: queued chunks are not worked on
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return state.finish()


def _replay_synapse(files, ranks, tables=None, chunk_rows: int = CHUNK_ROWS) -> dict[str, pa.Table]:
    """Every Synapse table but `frames`, in one pass over the capture in chunks of
    `chunk_rows` (replay/synapse_stream.py); `rows` only when `tables` asks for it."""
    from dcptool.replay.synapse_stream import lazy_results
    return lazy_results(files, ranks, tables, chunk_rows)


# ---------------------------------------------------------------------------------------
# user code: --apply module:function

def load_function(spec: str) -> Callable:
    """The function named by `--apply`: `module:function` (the module found in the working
    directory first, as `python -m` does, then on the Python path) or `path/to/file.py:function`
    (a path with a `/` or ending in `.py`, relative to the working directory). Dotted
    function names (`module:Class.method`) are followed. ImportError, AttributeError or
    ValueError with a one-line message when it cannot be found."""
    import os
    import sys

    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--apply wants module:function or file.py:function, got {spec!r}")
    if module.endswith(".py") or os.sep in module or "/" in module:
        path = os.path.abspath(os.path.expanduser(module))
        if not os.path.isfile(path):
            raise ImportError(f"no such file {module}")
        name = os.path.splitext(os.path.basename(path))[0]
        if not name.isidentifier():
            raise ValueError(f"{os.path.basename(path)} is not a valid module name")
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise ImportError(f"{module} would shadow the module {name!r} already loaded; rename the file")
        if loaded is None:
            # importable by its name, from its directory: Spark's workers import it so too
            # (replay/spark.py ships the file), and cloudpickle refers to it by that name
            folder = os.path.dirname(path)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            loaded = importlib.import_module(name)
        fn = loaded
    else:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)
        try:
            fn = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.split(".")[0] == exc.name.split(".")[0]:
                raise ImportError(f"no module named {exc.name!r} in the working directory "
                                  "or on the Python path") from None
            raise
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise AttributeError(f"{module} has no {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{spec} is not callable")
    return fn


def apply_group_key(protocol: str, t: pa.Table):
    """Group keys of `t` (rows of one group): vbucket for DCP, (stream, instance) for Synapse."""
    if protocol == "dcp":
        return t.column("vbucket")[0].as_py()
    return (_str(t.column("stream"))[0].as_py(), _str(t.column("instance"))[0].as_py())


def apply_sort_key(key):
    if isinstance(key, tuple):
        return tuple((v is not None, v or "") for v in key)
    return key


def apply_frames_mask(protocol: str, t: pa.Table) -> np.ndarray:
    """The frames user code sees: `in` frames of a vbucket (DCP) or a stream (Synapse)."""
    col = "vbucket" if protocol == "dcp" else "stream"
    return _is(t.column("direction"), "in") & _np(t.column(col).is_valid(), dtype=bool)


def concat_results(results: list[tuple[object, pa.Table]]) -> pa.Table | None:
    results = sorted(results, key=lambda kv: apply_sort_key(kv[0]))
    tables = [r for _, r in results if r is not None]
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="default")


def apply_local(files: list, fn: Callable) -> pa.Table | None:
    protocol = reader.protocol_of(files)
    t = reader.read_capture_table(files)
    t = t.filter(pa.array(apply_frames_mask(protocol, t)))
    if protocol == "dcp":
        g = _np(t.column("vbucket"), dtype=np.int64)
        order = np.argsort(g, kind="stable")
    else:
        s = pc.dictionary_encode(_str(t.column("stream")), null_encoding="encode")
        i = pc.dictionary_encode(_str(t.column("instance")), null_encoding="encode")
        g = _np(s.indices, dtype=np.int64) * (len(i.dictionary) + 1) + _np(i.indices, dtype=np.int64)
        order = np.argsort(g, kind="stable")
    t, g = t.take(order), g[order]
    bounds = np.flatnonzero(np.diff(g)) + 1 if len(g) else np.zeros(0, np.int64)
    results = []
    for s, e in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(g)]])):
        if e <= s:
            continue
        part = t.slice(int(s), int(e - s))
        key = apply_group_key(protocol, part)
        results.append((key, fn(key, part)))
    return concat_results(results)
