"""The DCP rules of REPLAY.md, shared by both engines: which frames move a vbucket
(`dcp_vbucket_frames`), the rollback answers (`rollback_mask`), and `DcpState`, which builds
documents, vbuckets, snapshots, rollbacks and failover from a vbucket's frames in capture order.
The local engine (local.py) feeds it chunk by chunk; the Spark engine (spark.py) runs it per
group of vbuckets (`dcp_group_tables`).

Frame order is carried by `_seq`, any int64 below 2**44 that grows with (started_at of the
capture, capture_id, frame_no). Rollbacks are the one rule that looks ahead (a rollback undoes
changes made before it), so the state takes the rollback answers up front."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.constants import Status
from dcptool.replay import tables as T
from dcptool.replay.store.schema import capture_schema
from dcptool.replay.columns import CHUNK_ROWS, NONE_TS, Grow, as_numpy, as_strings, equals, is_in, lookup_codes, ts_array, ts_ns

SEQ_BITS = 44
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


def dcp_vbucket_frames(t: pa.Table) -> np.ndarray:
    """Mask of the vbucket frames: `in`, with a vbucket, decoded, op of a vbucket stream."""
    return (equals(t.column("direction"), "in") & is_in(t.column("op"), VB_OPS) & as_numpy(t.column("vbucket").is_valid(), dtype=bool)
            & as_numpy(t.column("decode_error").is_null(), dtype=bool))


def rollback_mask(t: pa.Table) -> np.ndarray:
    """Mask of the ROLLBACK answers to stream requests (with the seqno to roll back to)."""
    return (equals(t.column("op"), "stream_req") & (as_numpy(t.column("status"), fill=0xFFFF, dtype=np.int64) == Status.ROLLBACK)
            & as_numpy(t.column("rollback_seqno").is_valid(), dtype=bool))


def vb_order_key(t: pa.Table) -> np.ndarray:
    """(vbucket, frame order) as one sortable int64."""
    return (as_numpy(t.column("vbucket"), dtype=np.int64) << SEQ_BITS) | as_numpy(t.column("_seq"), dtype=np.int64)


MARKER_COLUMNS = ["vbucket", "capture_id", "frame_no", "ts", "snap_version", "snap_start", "snap_end",
                  "snap_flags", "_seq"]
DOC_COLUMNS = ["vbucket", "collection_id", "key", "by_seqno", "rev_seqno", "cas", "op", "datatype",
               "item_flags", "expiration", "value_len", "capture_id", "frame_no", "ts", "_seq"]
# an undone change, for the `undone` table (with `_r`, the rollback that undid it)
UNDONE_COLUMNS = ["vbucket", "collection_id", "key", "by_seqno", "op", "capture_id", "frame_no", "ts"]
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
        self.rollbacks = rollbacks.take(np.argsort(vb_order_key(rollbacks), kind="stable"))
        self.r_vb = as_numpy(self.rollbacks.column("vbucket"), dtype=np.int64)
        self.r_seq = as_numpy(self.rollbacks.column("_seq"), dtype=np.int64)
        self.r_seqno = as_numpy(self.rollbacks.column("rollback_seqno"), dtype=np.int64)
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
        self.snaps = Grow(vb=(np.int64, 0), seq=(np.int64, 0), end=(np.int64, -1), items=(np.int64, 0),
                           hit_end=(bool, False), first_seqno=(np.int64, 0), has_first=(bool, False),
                           last_seqno=(np.int64, 0))
        self._markers: list[pa.Table] = []
        self._failover: list[pa.Table] = []   # stream-request successes with a failover log
        self._ends: list[pa.Table] = []       # stream ends
        self.docs: pa.Table | None = None     # the last surviving change per document so far
        self._parts: list[pa.Table] = []      # newer per-chunk changes not merged into docs yet
        self._parts_rows = 0
        self._dedupe_chunks, self._not_deduped = True, 0
        self._undone_rows: list[pa.Table] = []   # the changes rollbacks undid (rare)

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
        vb = as_numpy(chunk.column("vbucket"), dtype=np.int64)
        seq = as_numpy(chunk.column("_seq"), dtype=np.int64)
        ts = ts_ns(chunk.column("ts"))
        is_mut, is_del, is_exp, is_adv, is_marker, is_end, is_req = lookup_codes(
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
        seqno = as_numpy(chunk.column("by_seqno"), fill=-1, dtype=np.int64)

        # a stream-request success sets the vbucket's failover log, a stream end its reason
        # (the last one wins)
        ok = is_req & (as_numpy(chunk.column("status"), fill=0xFFFF, dtype=np.int64) == Status.SUCCESS)
        ok &= as_numpy(chunk.column("failover_log").is_valid(), dtype=bool)
        p.failover = chunk.select(["vbucket", "failover_log", "_seq"]).filter(pa.array(ok)) if ok.any() else None
        p.ends = (chunk.select(["vbucket", "stream_end_reason", "_seq"]).filter(pa.array(is_end))
                  if is_end.any() else None)

        # rollback: a change with by_seqno above rollback_seqno, made before the rollback and
        # not already undone, is undone by it
        undone_by = self._undone_by(vb, seq, seqno, is_change | is_adv)
        counted = undone_by[is_change & (undone_by >= 0)]
        p.undone = np.bincount(counted, minlength=len(self.r_vb)) if len(counted) else None
        p.undone_rows = None
        if len(counted):
            und = np.flatnonzero(is_change & (undone_by >= 0))
            u = chunk.select(UNDONE_COLUMNS).take(und)
            u = u.set_column(UNDONE_COLUMNS.index("op"), "op", as_strings(u.column("op")))
            u = u.set_column(UNDONE_COLUMNS.index("capture_id"), "capture_id", as_strings(u.column("capture_id")))
            p.undone_rows = u.append_column("_r", pa.array(undone_by[und], pa.int64()))
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
            part = part.set_column(DOC_COLUMNS.index("op"), "op", as_strings(part.column("op")))
            p.part = part.set_column(DOC_COLUMNS.index("capture_id"), "capture_id",
                                     as_strings(part.column("capture_id")))
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
        if p.undone_rows is not None:
            self._undone_rows.append(p.undone_rows)
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
        p.m_end = as_numpy(chunk.column("snap_end").take(mk), fill=-1, dtype=np.int64)
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

    def _undone_table(self) -> pa.Table:
        """`undone`: each change a rollback undid, with the rollback, and whether the document's
        current change (the last one not undone) was received after the rollback: `restored`,
        at `restored_seqno` (its by_seqno)."""
        schema = T.DCP_TABLES["undone"][0]
        if not self._undone_rows:
            return schema.empty_table()
        u = pa.concat_tables(self._undone_rows).combine_chunks()
        r = as_numpy(u.column("_r"), dtype=np.int64)
        rb = self.rollbacks.take(pa.array(r))
        r_seq = self.r_seq[r]
        # the current change of each document concerned (undone documents are few)
        current: dict = {}
        if self.docs is not None and self.docs.num_rows:
            d = self.docs.filter(pc.is_in(self.docs.column("key"), value_set=pc.unique(u.column("key"))))
            for vb, cid, key, seqno, seq in zip(*(d.column(c).to_pylist() for c in
                                                 ("vbucket", "collection_id", "key", "by_seqno", "_seq"))):
                current[(vb, cid, key)] = (seq, seqno)
        restored, restored_seqno = [], []
        for vb, cid, key, rs in zip(u.column("vbucket").to_pylist(), u.column("collection_id").to_pylist(),
                                    u.column("key").to_pylist(), r_seq.tolist()):
            doc = current.get((vb, cid, key))
            ok = doc is not None and doc[0] > rs
            restored.append(ok)
            restored_seqno.append(doc[1] if ok else None)
        return T.canonical("dcp", "undone", pa.table({
            "vbucket": u.column("vbucket"), "capture_id": as_strings(rb.column("capture_id")),
            "frame_no": rb.column("frame_no"), "ts": rb.column("ts"), "rollback_seqno": rb.column("rollback_seqno"),
            "collection_id": u.column("collection_id"), "key": u.column("key"), "by_seqno": u.column("by_seqno"),
            "op": u.column("op"), "change_capture_id": u.column("capture_id"), "change_frame_no": u.column("frame_no"),
            "change_ts": u.column("ts"), "restored": pa.array(restored, pa.bool_()),
            "restored_seqno": pa.array(restored_seqno, pa.int64())}))

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
        out["undone"] = self._undone_table()

        # snapshots, by (vbucket, frame order): complete by an item at snap_end, or the next
        # marker of the vbucket starting above it
        s = self.snaps
        order = np.lexsort((s.view("seq"), s.view("vb")))
        m = (pa.concat_tables(self._markers) if self._markers
             else pa.schema([capture_schema("dcp").field(c) for c in MARKER_COLUMNS[:-1]]
                            + [("_seq", pa.int64())]).empty_table()).take(order)
        m_vb = s.view("vb")[order]
        m_start = as_numpy(m.column("snap_start"), fill=-1, dtype=np.int64)
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
            "vbucket": m.column("vbucket"), "capture_id": as_strings(m.column("capture_id")),
            "frame_no": m.column("frame_no"), "ts": m.column("ts"),
            "snap_version": as_strings(m.column("snap_version")), "snap_start": m.column("snap_start"),
            "snap_end": m.column("snap_end"), "snap_flags": m.column("snap_flags"),
            "items": pa.array(items, pa.int64()),
            "first_seqno": pa.array(s.view("first_seqno")[order], pa.int64(), mask=~has_items),
            "last_seqno": pa.array(s.view("last_seqno")[order], pa.int64(), mask=~has_items),
            "complete": pa.array(complete, pa.bool_())}))

        r = self.rollbacks
        out["rollbacks"] = T.canonical("dcp", "rollbacks", pa.table({
            "vbucket": r.column("vbucket"), "capture_id": as_strings(r.column("capture_id")),
            "frame_no": r.column("frame_no"), "ts": r.column("ts"),
            "rollback_seqno": r.column("rollback_seqno"), "undone": pa.array(self.undone, pa.int64())}))

        # failover: the newest failover log, position 0 = newest entry as on the wire
        fo_type = capture_schema("dcp").field("failover_log").type
        f = _last_per_vbucket(pa.concat_tables(self._failover) if self._failover else pa.schema(
            [("vbucket", pa.uint16()), ("failover_log", fo_type), ("_seq", pa.int64())]).empty_table())
        fl = f.column("failover_log").combine_chunks() if f.num_rows else pa.array([], fo_type)
        lens = as_numpy(pc.list_value_length(fl), fill=0, dtype=np.int64) if len(fl) else np.zeros(0, np.int64)
        flat = pc.list_flatten(fl) if len(fl) else pa.array([], fl.type.value_type)
        vbs = np.repeat(as_numpy(f.column("vbucket"), dtype=np.int64), lens) if f.num_rows else np.zeros(0, np.int64)
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

        dvb = as_numpy(docs.column("vbucket"), dtype=np.int64)
        live_, deleted_, expired_ = lookup_codes(docs.column("state"), {"live"}, {"deleted"}, {"expired"})
        heads = [lst[0]["vbucket_uuid"] if lst else None for lst in fl.to_pylist()] if f.num_rows else []
        ends = _last_per_vbucket(pa.concat_tables(self._ends)) if self._ends else None
        has_high = self.has_high[vbs]
        out["vbuckets"] = T.canonical("dcp", "vbuckets", pa.table({
            "vbucket": pa.array(vbs, pa.uint16()),
            "vbucket_uuid": per_vbucket(as_numpy(f.column("vbucket"), dtype=np.int64) if f.num_rows
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
            "stream_end_reason": (per_vbucket(as_numpy(ends.column("vbucket"), dtype=np.int64),
                                              ends.column("stream_end_reason").to_pylist(), pa.uint32())
                                  if ends is not None else pa.nulls(nv, pa.uint32())),
            "first_ts": ts_array(self.first_ts[vbs], self.first_ts[vbs] != NONE_TS),
            "last_ts": ts_array(self.last_ts[vbs], self.last_ts[vbs] != INT64_MIN)}))
        return out


def _last_per_vbucket(t: pa.Table) -> pa.Table:
    """The last row (by _seq) of each vbucket."""
    if t.num_rows == 0:
        return t
    t = t.take(np.argsort(as_numpy(t.column("_seq"), dtype=np.int64), kind="stable"))
    last = np.full(1 << 16, -1, np.int64)
    np.maximum.at(last, as_numpy(t.column("vbucket"), dtype=np.int64), np.arange(t.num_rows))
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
        return as_numpy(enc.indices, fill=n - 1, dtype=np.int64)[rows], n
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
        codes[order[lo:hi]] = as_numpy(enc.indices, fill=n - 1, dtype=np.int64) + base
        base += n
    return codes, base


def _last_per_document_rows(t: pa.Table, rows: np.ndarray, by_vbucket: bool = False) -> np.ndarray:
    """Of `rows` (frame order within each vbucket), those that are the last change of their
    document (vbucket, collection_id, key): in the order of `rows`, or with `by_vbucket` by
    (vbucket, order in `rows`)."""
    vb = as_numpy(t.column("vbucket"), dtype=np.int64)[rows]
    order = (np.argsort(vb.astype(np.uint16), kind="stable")
             if by_vbucket or len(rows) > 2 * KEY_GROUP_ROWS else None)
    key, nkeys = _key_codes(t, rows, vb, order)
    cid = t.column("collection_id")
    cid = np.where(as_numpy(cid.is_valid(), dtype=bool), as_numpy(cid, fill=0, dtype=np.int64) + 1, 0)[rows]
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
    seq = as_numpy(frames.column("_seq"), dtype=np.int64)
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():
        frames = frames.take(np.argsort(seq, kind="stable"))
    state = DcpState(frames.filter(pa.array(rollback_mask(frames))))
    state.feed(frames)
    return state.finish()
