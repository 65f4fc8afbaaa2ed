"""The DCP rules of REPLAY.md over a vbucket's frames in capture order: which frames move a
vbucket (`dcp_vbucket_frames`), the rollback answers (`rollback_mask`), and `DcpState`, which
builds `vbuckets` and `snapshots` (the per-vbucket rules no SQL plan computes) and tracks no
document. The relational tables (`documents`, `undone`, `rollbacks`, `failover`, `history`) are
the SQL of replay/rules/plans.py, which DuckDB (in-process) and Spark run; `vbuckets`' document
counts (live, deleted, expired) are a GROUP BY over that `documents` table, joined in by
`with_document_counts`. The in-process engine (replay/local/engine.py) feeds DcpState chunk by
chunk; Spark's applyInArrow groups (replay/spark/arrow.py) call `dcp_group_tables`.

Frame order is carried by `_seq`, any int64 below 2**44 that grows with (started_at of the
capture, capture_id, frame_no). Rollbacks are the one rule that looks ahead (a rollback undoes
changes made before it), so the state takes the rollback answers up front."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.wire.constants import NUM_VB_SLOTS, Status, key_vb, stream_key
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.columns import (
    NONE_TS,
    Grow,
    as_numpy,
    as_strings,
    equals,
    is_in,
    lookup_codes,
    ts_array,
    ts_ns,
)
from dcptool.replay.rules.dcp_names import COLLECTION_DROP, DOC_STATES, VB_OPS  # noqa: F401 (dcp.VB_OPS ...: the names callers use)
from dcptool.replay.store.schema import capture_schema

SEQ_BITS = 44

DCP_FILTER_COLUMNS = ["direction", "vbucket", "op", "decode_error"]
DCP_STATE_COLUMNS = ["capture_id", "frame_no", "ts", "vbucket", "op", "status", "cas", "datatype",
                     "collection_id", "key", "value_len", "by_seqno", "rev_seqno", "item_flags",
                     "expiration", "snap_version", "snap_start", "snap_end", "snap_flags",
                     "stream_end_reason", "rollback_seqno", "failover_log", "system_event_id", "stream_id"]
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
INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
OSO_START, OSO_END = 0x01, 0x02      # flags of an oso_snapshot frame (its snap_flags column)
OSO_CLOSE = -3                       # an OSO end among a vbucket's rows (_prepare_snapshots)


_Arr = npt.NDArray[Any]


class _Prepared:
    """What `DcpState.prepare` found in a chunk, for `DcpState.apply`."""
    # per-vbucket activity and counters (arrays nvb long)
    nvb: int
    seen: _Arr
    first_ts: _Arr
    last_ts: _Arr
    counts: dict[str, _Arr]
    failover: pa.Table | None        # stream-request successes with a failover log
    ends: pa.Table | None            # stream ends
    sid_key: _Arr | None             # snapshots' key with stream ids (_stream_key)
    # snapshots (_prepare_snapshots): the chunk's markers, then its rows by (vbucket, frame order)
    markers: pa.Table | None
    m_vb: _Arr
    m_seq: _Arr
    m_end: _Arr
    m_oso: _Arr
    rvb: _Arr
    r_hi: _Arr
    inherited: _Arr
    closer: _Arr
    run_end: _Arr
    is_item: _Arr
    is_oso_end: _Arr
    run_first: _Arr
    r_seqno: _Arr
    r_change: _Arr


class DcpState:
    """Replays the DCP rules of REPLAY.md over vbucket frames, in one pass.

    `rollbacks` holds the ROLLBACK answers (`rollback_mask`) of every vbucket that will be
    fed: they are the only rule that looks ahead (a rollback undoes changes made before it).
    `feed` takes the vbucket frames in frame order, in chunks of any size; the state it keeps
    grows with snapshots and vbuckets, not with documents or frames. `finish` gives
    `vbuckets` (its document counts 0: with_document_counts) and `snapshots`."""

    def __init__(self, rollbacks: pa.Table):
        # vbuckets and snapshots only: documents are plans.py's SQL
        # a ROLLBACK response to a stream request rolls the vbucket back to rollback_seqno
        self.rollbacks = rollbacks.take(np.argsort(vb_order_key(rollbacks), kind="stable"))
        self.r_vb = as_numpy(self.rollbacks.column("vbucket"), dtype=np.int64)
        self.r_seq = as_numpy(self.rollbacks.column("_seq"), dtype=np.int64)
        self.r_seqno = as_numpy(self.rollbacks.column("rollback_seqno"), dtype=np.int64)

        size = 1 << 16
        self.seen = np.zeros(size, bool)
        self.first_ts = np.full(size, NONE_TS, np.int64)
        self.last_ts = np.full(size, INT64_MIN, np.int64)
        self.counts = {op_: np.zeros(size, np.int64) for op_ in DOC_STATES}
        self.high_seqno = np.full(size, -1, np.int64)
        self.has_high = np.zeros(size, bool)
        # snapshots: the marker each vbucket is in (-1: none, or closed by a stream end)
        self.current = np.full(size, -1, np.int64)
        self.with_sids = False     # stream ids seen: snapshots keyed by (vbucket, stream id)
        self.snaps = Grow(vb=(np.int64, 0), seq=(np.int64, 0), end=(np.int64, -1), items=(np.int64, 0),
                           hit_end=(bool, False), first_seqno=(np.int64, 0), has_first=(bool, False),
                           last_seqno=(np.int64, 0),
                           # OSO snapshots: whether it is one, its end arrived, lowest / highest seqno
                           oso=(bool, False), done=(bool, False), lo=(np.int64, INT64_MAX), hi=(np.int64, -1))
        self._markers: list[pa.Table] = []
        self._failover: list[pa.Table] = []   # stream-request successes with a failover log
        self._ends: list[pa.Table] = []       # stream ends

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
        is_mut, is_del, is_exp, is_adv, is_marker, is_end, is_req, is_prep, is_commit, is_abort, is_oso = lookup_codes(
            chunk.column("op"), {"mutation"}, {"deletion"}, {"expiration"}, {"seqno_advanced"},
            {"snapshot_marker"}, {"stream_end"}, {"stream_req"}, {"prepare"}, {"commit"}, {"abort"},
            {"oso_snapshot"})
        is_sync = is_prep | is_commit | is_abort

        # per-vbucket activity and counters (arrays as long as the highest vbucket + 1)
        p.nvb = nvb = int(vb.max()) + 1
        p.seen = np.bincount(vb, minlength=nvb) > 0
        p.first_ts = np.full(nvb, NONE_TS, np.int64)
        np.minimum.at(p.first_ts, vb, ts)
        p.last_ts = np.full(nvb, INT64_MIN, np.int64)
        np.maximum.at(p.last_ts, vb, np.where(ts == NONE_TS, INT64_MIN, ts))
        p.counts = {name: np.bincount(vb[m], minlength=nvb)
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
        # not already undone, is undone by it (which changes `undone` lists: plans.py's SQL)
        alive = self._undone_by(vb, seq, seqno, is_change | is_adv | is_sync) < 0

        # high_seqno: the highest seqno not undone (items and seqno-advanced)
        hi = (is_change | is_adv | is_sync) & alive

        # OSO snapshots (REPLAY.md): their `snap_flags` column holds the OSO flags
        oso_flags = as_numpy(chunk.column("snap_flags"), fill=0, dtype=np.int64) if is_oso.any() else 0
        p.sid_key = _stream_key(chunk, vb)
        self._prepare_snapshots(p, chunk, vb if p.sid_key is None else p.sid_key, seq, seqno, is_marker, is_end,
                                is_change | is_sync, is_adv, is_oso & (oso_flags & OSO_START != 0),
                                is_oso & (oso_flags & OSO_END != 0), hi)
        return p

    def apply(self, p: "_Prepared | None") -> None:
        if p is None:
            return
        v = slice(0, p.nvb)
        self.seen[v] |= p.seen
        np.minimum(self.first_ts[v], p.first_ts, out=self.first_ts[v])
        np.maximum(self.last_ts[v], p.last_ts, out=self.last_ts[v])
        for name, c in p.counts.items():
            self.counts[name][v] += c
        if p.failover is not None:
            self._failover.append(p.failover)
        if p.ends is not None:
            self._ends.append(p.ends)
        # high_seqno there too: an OSO snapshot's seqnos count at its end
        self.with_sids |= p.sid_key is not None
        self._apply_snapshots(p)

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
    def _prepare_snapshots(p, chunk, vb, seq, seqno, is_marker, is_end, is_change, is_adv,
                           oso_start, oso_end, hi) -> None:
        """A snapshot marker (or an OSO snapshot start) opens a snapshot; its items follow
        until the next marker, a stream end or an OSO end. Here: each row's closer within the
        chunk (markers numbered from 0)."""
        mk = np.flatnonzero(is_marker | oso_start)
        p.markers = chunk.select(MARKER_COLUMNS).take(mk) if len(mk) else None
        p.m_vb, p.m_seq = vb[mk], seq[mk]
        p.m_end = as_numpy(chunk.column("snap_end").take(mk), fill=-1, dtype=np.int64)
        p.m_oso = oso_start[mk]
        rows = np.flatnonzero(is_marker | is_end | is_change | is_adv | oso_start | oso_end)
        rows = rows[np.argsort(vb[rows].astype(np.uint16), kind="stable")]   # by (vbucket, frame order)
        p.rvb = rvb = vb[rows]
        p.r_hi = hi[rows]
        # what each row is: a marker (its number), a stream end (-1), an OSO end (-3) or an item (-2)
        what = np.full(len(vb), -2, np.int64)
        what[mk] = np.arange(len(mk))
        what[is_end] = -1
        what[oso_end] = OSO_CLOSE
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
        p.is_oso_end = w == OSO_CLOSE
        p.run_first = start
        p.r_seqno = seqno[rows]
        p.r_change = is_change[rows]

    def _apply_snapshots(self, p) -> None:
        s = self.snaps
        base = s.n
        if p.markers is not None:
            self._markers.append(p.markers)
            s.extend(len(p.m_vb), vb=p.m_vb, seq=p.m_seq, end=p.m_end, oso=p.m_oso)
        if len(p.rvb) == 0:
            return
        mi = np.where(p.inherited, self.current[p.rvb], np.where(p.closer >= 0, p.closer + base, -1))
        before = np.where(p.run_first, self.current[p.rvb], np.roll(mi, 1))   # each row's snapshot before it
        self.current[p.rvb[p.run_end]] = mi[p.run_end]
        self._apply_oso(p, mi, before)
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

    def _apply_oso(self, p, mi, before) -> None:
        """high_seqno, and what an OSO snapshot holds: the seqnos (items and seqno advanced)
        of an OSO snapshot count for high_seqno only once its end arrives (REPLAY.md)."""
        s = self.snaps
        in_oso = (mi >= 0) & s.oso[np.maximum(mi, 0)]
        out = p.r_hi & ~in_oso
        np.maximum.at(self.high_seqno, self._vb_of(p.rvb[out]), p.r_seqno[out])
        self.has_high[self._vb_of(p.rvb[out])] = True
        held = p.r_hi & in_oso
        if held.any():
            np.maximum.at(s.hi, mi[held], p.r_seqno[held])
            np.minimum.at(s.lo, mi[held], p.r_seqno[held])
        ends = p.is_oso_end & (before >= 0)
        if ends.any():
            sm = before[ends]
            ok = s.oso[sm]
            sm, evb = sm[ok], self._vb_of(p.rvb[ends][ok])
            s.done[sm] = True
            got = s.hi[sm] >= 0
            np.maximum.at(self.high_seqno, evb[got], s.hi[sm][got])
            self.has_high[evb[got]] = True

    def _vb_of(self, keys: np.ndarray) -> np.ndarray:
        """The vbuckets of snapshot keys (_stream_key)."""
        return key_vb(keys) if self.with_sids else keys

    def finish(self) -> dict[str, pa.Table]:
        """`vbuckets` (document counts 0) and `snapshots`."""
        doc_counts = {state: np.zeros(1 << 16, np.int64) for state in DOC_STATES.values()}
        snapshots, m_vb, complete = self._snapshots_table()
        f, fl = self._last_failover_logs()
        return {"vbuckets": self._vbuckets_table(doc_counts, m_vb, complete, f, fl), "snapshots": snapshots}

    def _snapshots_table(self) -> tuple[pa.Table, np.ndarray, np.ndarray]:
        """`snapshots`, by (vbucket, frame order): complete by an item at snap_end, or the next
        marker of the vbucket starting above it. Also each marker's snapshot key and whether
        it is complete (for `vbuckets`)."""
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
        oso = s.view("oso")[order]
        snap_version, snap_start, snap_end, snap_flags = (as_strings(m.column("snap_version")), m.column("snap_start"),
                                                          m.column("snap_end"), m.column("snap_flags"))
        if oso.any():   # an OSO snapshot (REPLAY.md): complete at its end; its range from its seqnos
            complete = np.where(oso, s.view("done")[order], complete)
            lo, hi = s.view("lo")[order], s.view("hi")[order]
            snap_version = pc.if_else(pa.array(oso), "oso", snap_version)
            snap_start = pc.if_else(pa.array(oso), pa.array(lo, pa.int64(), mask=hi < 0), snap_start)
            snap_end = pc.if_else(pa.array(oso), pa.array(hi, pa.int64(), mask=hi < 0), snap_end)
            snap_flags = pc.if_else(pa.array(oso), pa.nulls(nm, snap_flags.type), snap_flags)
        table = T.canonical("dcp", "snapshots", pa.table({
            "vbucket": m.column("vbucket"), "capture_id": as_strings(m.column("capture_id")),
            "frame_no": m.column("frame_no"), "ts": m.column("ts"),
            "snap_version": snap_version, "snap_start": snap_start,
            "snap_end": snap_end, "snap_flags": snap_flags,
            "items": pa.array(items, pa.int64()),
            "first_seqno": pa.array(s.view("first_seqno")[order], pa.int64(), mask=~has_items),
            "last_seqno": pa.array(s.view("last_seqno")[order], pa.int64(), mask=~has_items),
            "complete": pa.array(complete, pa.bool_())}))
        return table, m_vb, complete

    def _last_failover_logs(self) -> tuple[pa.Table, pa.Array]:
        """The last stream-request success (with a failover log) of each vbucket, and those
        logs (for `vbuckets`' vbucket_uuid)."""
        fo_type = capture_schema("dcp").field("failover_log").type
        f = _last_per_vbucket(pa.concat_tables(self._failover) if self._failover else pa.schema(
            [("vbucket", pa.uint16()), ("failover_log", fo_type), ("_seq", pa.int64())]).empty_table())
        fl = f.column("failover_log").combine_chunks() if f.num_rows else pa.array([], fo_type)
        return f, fl

    def _vbuckets_table(self, doc_counts: dict, m_vb: np.ndarray, complete: np.ndarray, f: pa.Table,
                        fl: pa.Array) -> pa.Table:
        """`vbuckets`: one row per vbucket seen."""
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

        heads = [lst[0]["vbucket_uuid"] if lst else None for lst in fl.to_pylist()] if f.num_rows else []
        ends = _last_per_vbucket(pa.concat_tables(self._ends)) if self._ends else None
        has_high = self.has_high[vbs]
        return T.canonical("dcp", "vbuckets", pa.table({
            "vbucket": pa.array(vbs, pa.uint16()),
            "vbucket_uuid": per_vbucket(as_numpy(f.column("vbucket"), dtype=np.int64) if f.num_rows
                                        else np.zeros(0, np.int64), heads, pa.uint64()),
            "high_seqno": pa.array(self.high_seqno[vbs], pa.int64(), mask=~has_high),
            "live": pa.array(doc_counts["live"][vbs], pa.int64()),
            "deleted": pa.array(doc_counts["deleted"][vbs], pa.int64()),
            "expired": pa.array(doc_counts["expired"][vbs], pa.int64()),
            "mutations": pa.array(self.counts["mutation"][vbs], pa.int64()),
            "deletions": pa.array(self.counts["deletion"][vbs], pa.int64()),
            "expirations": pa.array(self.counts["expiration"][vbs], pa.int64()),
            "snapshots": pa.array(np.bincount(self._vb_of(m_vb), minlength=1 << 16)[vbs], pa.int64()),
            "rollbacks": pa.array(np.bincount(self.r_vb, minlength=1 << 16)[vbs], pa.int64()),
            "last_snapshot_complete": per_vbucket(self._vb_of(m_vb), complete.tolist(), pa.bool_()),
            "stream_end_reason": (per_vbucket(as_numpy(ends.column("vbucket"), dtype=np.int64),
                                              ends.column("stream_end_reason").to_pylist(), pa.uint32())
                                  if ends is not None else pa.nulls(nv, pa.uint32())),
            "first_ts": ts_array(self.first_ts[vbs], self.first_ts[vbs] != NONE_TS),
            "last_ts": ts_array(self.last_ts[vbs], self.last_ts[vbs] != INT64_MIN)}))




def _stream_key(chunk: pa.Table, vb: _Arr) -> _Arr | None:
    """The key snapshots are tracked by (REPLAY.md) with stream ids (two streams' markers
    interleave on one vbucket): vbucket + 1024 x stream id; ids above 62 (never ours) share
    one key and a vbucket above 1023 keeps its own, so the arrays stay 2^16 long. None: no
    stream ids in the chunk, the key is the vbucket."""
    if "stream_id" not in chunk.column_names or chunk.column("stream_id").null_count == chunk.num_rows:
        return None
    sid = np.minimum(as_numpy(chunk.column("stream_id"), fill=0, dtype=np.int64), 63)
    return np.where(vb < NUM_VB_SLOTS, stream_key(vb, sid), vb)


def _last_per_vbucket(t: pa.Table) -> pa.Table:
    """The last row (by _seq) of each vbucket."""
    if t.num_rows == 0:
        return t
    t = t.take(np.argsort(as_numpy(t.column("_seq"), dtype=np.int64), kind="stable"))
    last = np.full(1 << 16, -1, np.int64)
    np.maximum.at(last, as_numpy(t.column("vbucket"), dtype=np.int64), np.arange(t.num_rows))
    return t.take(np.sort(last[last >= 0]))


def dcp_group_tables(frames: pa.Table) -> dict[str, pa.Table]:
    """`vbuckets` (document counts 0) and `snapshots` of vbucket frames held in memory (any
    order)."""
    seq = as_numpy(frames.column("_seq"), dtype=np.int64)
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():
        frames = frames.take(np.argsort(seq, kind="stable"))
    state = DcpState(frames.filter(pa.array(rollback_mask(frames))))
    state.feed(frames)
    return state.finish()


def with_document_counts(vbuckets: pa.Table, counts: pa.Table) -> pa.Table:
    """`vbuckets` with its `live`, `deleted` and `expired` columns from `counts` (vbucket, live,
    deleted, expired: the documents of each vbucket in each state, a GROUP BY over the
    `documents` table); a vbucket with no document counts 0."""
    at = np.zeros(1 << 16, np.int64) - 1
    if counts.num_rows:
        at[as_numpy(counts.column("vbucket"), dtype=np.int64)] = np.arange(counts.num_rows)
    rows = at[as_numpy(vbuckets.column("vbucket"), dtype=np.int64)] if vbuckets.num_rows else np.zeros(0, np.int64)
    for name in DOC_STATES.values():
        values = as_numpy(counts.column(name), fill=0, dtype=np.int64) if counts.num_rows else np.zeros(0, np.int64)
        col = np.where(rows >= 0, values[np.maximum(rows, 0)] if len(values) else 0, 0)
        vbuckets = vbuckets.set_column(vbuckets.schema.get_field_index(name), vbuckets.schema.field(name),
                                       pa.array(col.astype(np.int64), pa.int64()))
    return vbuckets
