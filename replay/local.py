"""The reference engine: REPLAY.md as columnar passes with pyarrow and numpy.

Every rule of REPLAY.md is one short block below, named after it. The functions that hold
the semantics (`DcpState`, `synapse_tables`) take frames of any set of vbuckets (or
Synapse streams) and are what the Spark engine runs per group, so both engines share them.

Frame order is carried by `_seq`, any int64 below 2**44 that grows with (started_at of the
capture, capture_id, frame_no): the local engine uses the row's position in the ordered
captures, Spark ranks rows inside a group. Connections are told apart by `_conn`
(capture rank << 32 | conn): a reconnect is a change of `_conn`.

DCP state is built in two passes so that memory grows with documents, not frames: the
first pass keeps only control frames (snapshot markers, stream ends, stream-request
responses); the second feeds item frames chunk by chunk, and every piece of state it keeps
(last change per document, counters, minima and maxima) merges independently of how the
frames are chunked.
"""

from __future__ import annotations

import importlib
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
CONTROL_OPS = ("snapshot_marker", "stream_end", "stream_req")
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
DCP_CONTROL_COLUMNS = ["capture_id", "frame_no", "ts", "vbucket", "op", "status", "snap_version",
                       "snap_start", "snap_end", "snap_flags", "stream_end_reason", "rollback_seqno",
                       "failover_log"]
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


def _is(col, value) -> np.ndarray:
    return _np(pc.equal(_str(col), value), fill=False, dtype=bool)


def _is_in(col, values) -> np.ndarray:
    return _np(pc.is_in(_str(col), value_set=pa.array(values, pa.string())), fill=False, dtype=bool)


def _ts(col) -> np.ndarray:
    return _np(col.cast(pa.int64()) if not isinstance(col, pa.ChunkedArray) else col.cast(pa.int64()),
               fill=NONE_TS, dtype=np.int64)


def _ts_array(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None else ~valid
    return pa.array(values.astype(np.int64), pa.int64(), mask=mask).cast(T.TS)


# ---------------------------------------------------------------------------------------
# DCP

def dcp_vbucket_frames(t: pa.Table) -> np.ndarray:
    """Mask of the vbucket frames: `in`, with a vbucket, decoded, op of a vbucket stream."""
    return (_is(t.column("direction"), "in") & _np(t.column("vbucket").is_valid(), dtype=bool)
            & _np(t.column("decode_error").is_null(), dtype=bool) & _is_in(t.column("op"), VB_OPS))


def _ck(t: pa.Table) -> np.ndarray:
    """(vbucket, frame order) as one sortable int64."""
    return (_np(t.column("vbucket"), dtype=np.int64) << SEQ_BITS) | _np(t.column("_seq"), dtype=np.int64)


class DcpState:
    """Replays the DCP rules of REPLAY.md over vbucket frames. `control` holds the control
    frames (snapshot markers, stream ends, stream-request responses) of every vbucket that
    will be fed; `feed` takes item frames in chunks of any size, in any order."""

    def __init__(self, control: pa.Table):
        control = control.take(np.argsort(_ck(control), kind="stable"))
        ck = _ck(control)
        vb = _np(control.column("vbucket"), dtype=np.int64)
        op = control.column("op")
        status = _np(control.column("status"), fill=0xFFFF, dtype=np.int64)
        is_marker = _is(op, "snapshot_marker")
        is_end = _is(op, "stream_end")
        is_req = _is(op, "stream_req")

        # a snapshot marker opens a snapshot; its items follow until the next marker or stream end
        self.markers = control.filter(pa.array(is_marker))
        self.m_vb = vb[is_marker]
        self.m_start = _np(self.markers.column("snap_start"), fill=-1, dtype=np.int64)
        self.m_end = _np(self.markers.column("snap_end"), fill=-1, dtype=np.int64)
        closers = is_marker | is_end
        self.c_ck = ck[closers]
        self.c_vb = vb[closers]
        self.c_marker = np.where(is_marker, np.cumsum(is_marker) - 1, -1)[closers]
        nm = len(self.m_vb)
        self.items = np.zeros(nm, np.int64)
        self.hit_end = np.zeros(nm, bool)
        self.first_ck = np.full(nm, np.iinfo(np.int64).max)
        self.first_seqno = np.zeros(nm, np.int64)
        self.last_ck = np.full(nm, -1, np.int64)
        self.last_seqno = np.zeros(nm, np.int64)

        # a ROLLBACK response to a stream request rolls the vbucket back to rollback_seqno
        is_rb = is_req & (status == STATUS_ROLLBACK) & _np(control.column("rollback_seqno").is_valid(), dtype=bool)
        self.rollbacks = control.filter(pa.array(is_rb))
        self.r_vb = vb[is_rb]
        self.r_ck = ck[is_rb]
        self.r_seqno = _np(self.rollbacks.column("rollback_seqno"), dtype=np.int64)
        self.undone = np.zeros(len(self.r_vb), np.int64)

        # a stream-request success response sets the vbucket's failover log (the last one wins)
        is_ok = is_req & (status == STATUS_SUCCESS) & _np(control.column("failover_log").is_valid(), dtype=bool)
        self.failover = _last_per_vbucket(control.filter(pa.array(is_ok)))
        # stream end records its reason (the last one wins)
        self.stream_ends = _last_per_vbucket(control.filter(pa.array(is_end)))

        size = 1 << 16
        self.seen = np.zeros(size, bool)
        self.first_ts = np.full(size, NONE_TS, np.int64)
        self.last_ts = np.full(size, np.iinfo(np.int64).min, np.int64)
        self.counts = {op_: np.zeros(size, np.int64) for op_ in DOC_STATES}
        self.high_seqno = np.full(size, -1, np.int64)
        self.has_high = np.zeros(size, bool)
        self.docs: pa.Table | None = None  # the last surviving change per document so far
        self._parts: list[pa.Table] = []    # newer per-chunk changes not merged into docs yet
        self._parts_rows = 0

    def feed(self, chunk: pa.Table) -> None:
        if chunk.num_rows == 0:
            return
        vb = _np(chunk.column("vbucket"), dtype=np.int64)
        ck = _ck(chunk)
        ts = _ts(chunk.column("ts"))
        op = chunk.column("op")

        # per-vbucket activity and counters
        u, inv = np.unique(vb, return_inverse=True)
        self.seen[u] = True
        fts = np.full(len(u), NONE_TS, np.int64)
        np.minimum.at(fts, inv, ts)
        lts = np.full(len(u), np.iinfo(np.int64).min, np.int64)
        np.maximum.at(lts, inv, np.where(ts == NONE_TS, np.iinfo(np.int64).min, ts))
        self.first_ts[u] = np.minimum(self.first_ts[u], fts)
        self.last_ts[u] = np.maximum(self.last_ts[u], lts)
        is_change = np.zeros(chunk.num_rows, bool)
        for name in DOC_STATES:
            m = _is(op, name)
            is_change |= m
            self.counts[name] += np.bincount(vb[m], minlength=1 << 16)
        is_adv = _is(op, "seqno_advanced")
        sel = np.flatnonzero(is_change | is_adv)
        if len(sel) == 0:
            return
        sel = sel[np.argsort(ck[sel], kind="stable")]
        s_ck, s_vb = ck[sel], vb[sel]
        s_change = is_change[sel]
        s_seqno = _np(chunk.column("by_seqno").take(sel), fill=-1, dtype=np.int64)

        # rollback: a change with by_seqno above rollback_seqno, not already undone, is undone
        undone_by = np.full(len(sel), -1, np.int64)
        for r in range(len(self.r_vb)):
            lo = np.searchsorted(s_ck, self.r_vb[r] << SEQ_BITS)
            hi = np.searchsorted(s_ck, self.r_ck[r])
            seg = undone_by[lo:hi]
            seg[(s_seqno[lo:hi] > self.r_seqno[r]) & (seg < 0)] = r
        counted = undone_by[s_change & (undone_by >= 0)]
        self.undone += np.bincount(counted, minlength=len(self.r_vb))
        alive = undone_by < 0

        # high_seqno: the highest seqno not undone (items and seqno-advanced)
        hv = s_vb[alive]
        if len(hv):
            hu, hinv = np.unique(hv, return_inverse=True)
            hmax = np.full(len(hu), -1, np.int64)
            np.maximum.at(hmax, hinv, s_seqno[alive])
            self.high_seqno[hu] = np.where(self.has_high[hu], np.maximum(self.high_seqno[hu], hmax), hmax)
            self.has_high[hu] = True

        # snapshots: which marker each item belongs to; completeness by seqno == snap_end
        if len(self.c_ck):
            j = np.searchsorted(self.c_ck, s_ck, side="right") - 1
            jj = np.maximum(j, 0)
            inside = (j >= 0) & (self.c_vb[jj] == s_vb) & (self.c_marker[jj] >= 0)
            mi = self.c_marker[jj]
            hit = inside & (s_seqno == self.m_end[mi])
            self.hit_end[mi[hit]] = True
            item = inside & s_change
            imi, ick, iseq = mi[item], s_ck[item], s_seqno[item]  # ordered by ck, so imi ascends
            self.items += np.bincount(imi, minlength=len(self.items))
            if len(imi):
                uf, first_i = np.unique(imi, return_index=True)
                better = ick[first_i] < self.first_ck[uf]
                self.first_ck[uf[better]] = ick[first_i][better]
                self.first_seqno[uf[better]] = iseq[first_i][better]
                last_i = len(imi) - 1 - np.unique(imi[::-1], return_index=True)[1]
                better = ick[last_i] > self.last_ck[uf]
                self.last_ck[uf[better]] = ick[last_i][better]
                self.last_seqno[uf[better]] = iseq[last_i][better]

        # mutation, deletion, expiration: the document takes the change; the later frame wins
        keep = sel[s_change & alive]   # in frame order within each vbucket
        if len(keep):
            # only each document's last change in this chunk is taken out of it
            doc = _document_ids(chunk, keep, vb[keep])
            _, first_in_reversed = np.unique(doc[::-1], return_index=True)
            keep = keep[np.sort(len(keep) - 1 - first_in_reversed)]
            cols = ["vbucket", "collection_id", "key", "by_seqno", "rev_seqno", "cas", "op",
                    "datatype", "item_flags", "expiration", "value_len", "capture_id", "frame_no",
                    "ts", "_seq"]
            part = chunk.select(cols).take(keep)
            part = part.set_column(cols.index("op"), "op", _str(part.column("op")))
            part = part.set_column(cols.index("capture_id"), "capture_id", _str(part.column("capture_id")))
            self._parts.append(part)
            self._parts_rows += part.num_rows
            # merge once the pending changes are as many as the documents: amortised linear
            if self._parts_rows >= max(CHUNK_ROWS, self.docs.num_rows if self.docs is not None else 0):
                self._merge_docs()

    def _merge_docs(self) -> None:
        if self._parts:
            tables = ([self.docs] if self.docs is not None else []) + self._parts
            self.docs = _last_per_document(pa.concat_tables(tables))
            self._parts, self._parts_rows = [], 0

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

        # snapshots: complete by an item at snap_end, or the next marker starting above it
        nm = len(self.m_vb)
        nxt_above = np.zeros(nm, bool)
        if nm > 1:
            same = self.m_vb[1:] == self.m_vb[:-1]
            nxt_above[:-1] = same & (self.m_start[1:] > self.m_end[:-1])
        complete = self.hit_end | nxt_above
        has_items = self.items > 0
        m = self.markers
        out["snapshots"] = T.canonical("dcp", "snapshots", pa.table({
            "vbucket": m.column("vbucket"), "capture_id": _str(m.column("capture_id")),
            "frame_no": m.column("frame_no"), "ts": m.column("ts"),
            "snap_version": _str(m.column("snap_version")), "snap_start": m.column("snap_start"),
            "snap_end": m.column("snap_end"), "snap_flags": m.column("snap_flags"),
            "items": pa.array(self.items, pa.int64()),
            "first_seqno": pa.array(self.first_seqno, pa.int64(), mask=~has_items),
            "last_seqno": pa.array(self.last_seqno, pa.int64(), mask=~has_items),
            "complete": pa.array(complete, pa.bool_())}))

        r = self.rollbacks
        out["rollbacks"] = T.canonical("dcp", "rollbacks", pa.table({
            "vbucket": r.column("vbucket"), "capture_id": _str(r.column("capture_id")),
            "frame_no": r.column("frame_no"), "ts": r.column("ts"),
            "rollback_seqno": r.column("rollback_seqno"), "undone": pa.array(self.undone, pa.int64())}))

        # failover: the newest failover log, position 0 = newest entry as on the wire
        f = self.failover
        fl = (f.column("failover_log").combine_chunks() if f.num_rows
              else pa.array([], capture_schema("dcp").field("failover_log").type))
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

        dvb = _np(docs.column("vbucket"), dtype=np.int64)
        dstate = docs.column("state")
        live = np.bincount(dvb[_is(dstate, "live")], minlength=1 << 16)[vbs]
        deleted = np.bincount(dvb[_is(dstate, "deleted")], minlength=1 << 16)[vbs]
        expired = np.bincount(dvb[_is(dstate, "expired")], minlength=1 << 16)[vbs]
        snaps = np.bincount(self.m_vb, minlength=1 << 16)[vbs]
        rbs = np.bincount(self.r_vb, minlength=1 << 16)[vbs]
        uuid = pa.nulls(nv, pa.uint64())
        last_complete = pa.nulls(nv, pa.bool_())
        end_reason = pa.nulls(nv, pa.uint32())
        lookup = {int(v): i for i, v in enumerate(vbs)}
        if f.num_rows:
            vals = [None] * nv
            for v, lst in zip(f.column("vbucket").to_pylist(), fl.to_pylist()):
                if v in lookup and lst:
                    vals[lookup[v]] = lst[0]["vbucket_uuid"]
            uuid = pa.array(vals, pa.uint64())
        if nm:
            last_idx = {}
            for i, v in enumerate(self.m_vb.tolist()):
                last_idx[v] = i
            vals = [None] * nv
            for v, i in last_idx.items():
                if v in lookup:
                    vals[lookup[v]] = bool(complete[i])
            last_complete = pa.array(vals, pa.bool_())
        if self.stream_ends.num_rows:
            vals = [None] * nv
            for v, reason in zip(self.stream_ends.column("vbucket").to_pylist(),
                                 self.stream_ends.column("stream_end_reason").to_pylist()):
                if v in lookup:
                    vals[lookup[v]] = reason
            end_reason = pa.array(vals, pa.uint32())
        has_high = self.has_high[vbs]
        out["vbuckets"] = T.canonical("dcp", "vbuckets", pa.table({
            "vbucket": pa.array(vbs, pa.uint16()), "vbucket_uuid": uuid,
            "high_seqno": pa.array(self.high_seqno[vbs], pa.int64(), mask=~has_high),
            "live": pa.array(live, pa.int64()), "deleted": pa.array(deleted, pa.int64()),
            "expired": pa.array(expired, pa.int64()),
            "mutations": pa.array(self.counts["mutation"][vbs], pa.int64()),
            "deletions": pa.array(self.counts["deletion"][vbs], pa.int64()),
            "expirations": pa.array(self.counts["expiration"][vbs], pa.int64()),
            "snapshots": pa.array(snaps, pa.int64()), "rollbacks": pa.array(rbs, pa.int64()),
            "last_snapshot_complete": last_complete, "stream_end_reason": end_reason,
            "first_ts": _ts_array(self.first_ts[vbs], self.first_ts[vbs] != NONE_TS),
            "last_ts": _ts_array(self.last_ts[vbs], self.last_ts[vbs] != np.iinfo(np.int64).min)}))
        return out


def _last_per_vbucket(t: pa.Table) -> pa.Table:
    """The last row (by _seq) of each vbucket."""
    if t.num_rows == 0:
        return t
    t = t.take(np.argsort(_np(t.column("_seq"), dtype=np.int64), kind="stable"))
    t = t.append_column("_row", pa.array(np.arange(t.num_rows), pa.int64()))
    last = t.group_by(["vbucket"], use_threads=False).aggregate([("_row", "max")])
    return t.take(np.sort(_np(last.column("_row_max"), dtype=np.int64)))


def _document_ids(t: pa.Table, rows: np.ndarray | None = None, vb: np.ndarray | None = None) -> np.ndarray:
    """One int64 per row (of `rows`, default all) naming its document (vbucket,
    collection_id, key): the key's dictionary index, the collection's, the vbucket."""
    key = t.column("key").combine_chunks()
    indices = pc.dictionary_encode(key).indices
    key_idx = np.where(_np(pc.is_null(indices)), 0, _np(indices, fill=0, dtype=np.int64) + 1)
    cid_col = t.column("collection_id")
    cid = np.where(_np(pc.is_null(cid_col)), -1, _np(cid_col, fill=0, dtype=np.int64))
    if rows is not None:
        key_idx, cid = key_idx[rows], cid[rows]
    if vb is None:
        vb = _np(t.column("vbucket"), dtype=np.int64)
    _, cid_idx = np.unique(cid, return_inverse=True)
    ncid = int(cid_idx.max()) + 1 if len(cid_idx) else 1
    width = max(1, int(key_idx.max()) + 1 if len(key_idx) else 1)
    if width * ncid >= 1 << 46:   # more documents than fit beside 16 vbucket bits: rank them
        _, key_idx = np.unique(key_idx * ncid + cid_idx, return_inverse=True)
        return (key_idx.astype(np.int64) << 16) | vb
    return ((key_idx * ncid + cid_idx.astype(np.int64)) << 16) | vb


def _last_per_document(t: pa.Table) -> pa.Table:
    """The row with the highest _seq of each (vbucket, collection_id, key)."""
    seq = _np(t.column("_seq"), dtype=np.int64)
    if len(seq) > 1 and not (seq[1:] >= seq[:-1]).all():
        t = t.take(np.argsort(seq, kind="stable"))
    if t.num_rows == 0:
        return t
    # the last occurrence of each document is the first one in the reversed order
    doc = _document_ids(t)
    _, first_in_reversed = np.unique(doc[::-1], return_index=True)
    return t.take(np.sort(t.num_rows - 1 - first_in_reversed))


def control_mask(t: pa.Table) -> np.ndarray:
    return _is_in(t.column("op"), CONTROL_OPS)


def dcp_group_tables(frames: pa.Table) -> dict[str, pa.Table]:
    """All DCP tables (but `frames`) for vbucket frames held in memory (one chunk)."""
    state = DcpState(frames.filter(pa.array(control_mask(frames))))
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
    for t in reader.iter_capture_tables(files, columns, batch_rows=batch_rows):
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


def replay_local(files: list, chunk_rows: int = CHUNK_ROWS) -> Replay:
    protocol = reader.protocol_of(files)
    ranks = reader.capture_ranks(files)
    if protocol == "dcp":
        return Replay(protocol, files, _replay_dcp(files, ranks, chunk_rows))
    return Replay(protocol, files, _replay_synapse(files, ranks))


def _chunks(t: pa.Table, rows: int) -> Iterator[pa.Table]:
    for s in range(0, t.num_rows, rows):
        yield t.slice(s, rows)


def _replay_dcp(files, ranks, chunk_rows) -> dict[str, pa.Table]:
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_CONTROL_COLUMNS))
    controls = []
    for t in _ordered(files, cols, ranks):  # pass 1: control frames only
        for c in _chunks(t, chunk_rows):
            keep = dcp_vbucket_frames(c) & control_mask(c)
            if keep.any():
                controls.append(c.filter(pa.array(keep)).select(DCP_CONTROL_COLUMNS + ["_seq"]))
    schema = pa.schema([capture_schema("dcp").field(c) for c in DCP_CONTROL_COLUMNS] + [("_seq", pa.int64())])
    state = DcpState(pa.concat_tables(controls) if controls else schema.empty_table())
    cols = list(dict.fromkeys(DCP_FILTER_COLUMNS + DCP_STATE_COLUMNS))
    for t in _ordered(files, cols, ranks):  # pass 2: item frames, chunk by chunk
        for c in _chunks(t, chunk_rows):
            keep = dcp_vbucket_frames(c)
            if keep.any():
                state.feed(c.filter(pa.array(keep)).select(DCP_STATE_COLUMNS + ["_seq"]))
    return state.finish()


def _replay_synapse(files, ranks) -> dict[str, pa.Table]:
    cols = list(dict.fromkeys(["direction", "decode_error"] + SYN_STATE_COLUMNS))
    parts, commands, max_conn = [], [], -1
    for t in _ordered(files, cols, ranks):
        if t.num_rows:
            max_conn = max(max_conn, int(pc.max(t.column("_conn")).as_py()))
        commands.append(t.select(["command", "ts"]))
        keep = synapse_group_frames(t)
        parts.append(t.filter(pa.array(keep)).select(SYN_STATE_COLUMNS + ["_seq", "_conn"]))
    schema = pa.schema([capture_schema("synapse").field(c) for c in SYN_STATE_COLUMNS]
                       + [("_seq", pa.int64()), ("_conn", pa.int64())])
    frames = pa.concat_tables(parts) if parts else schema.empty_table()
    out = synapse_tables(frames, max_conn)
    cmd_schema = pa.schema([capture_schema("synapse").field("command"), capture_schema("synapse").field("ts")])
    out["commands"] = commands_table(pa.concat_tables(commands) if commands else cmd_schema.empty_table())
    return out


# ---------------------------------------------------------------------------------------
# user code: --apply module:function

def load_function(spec: str) -> Callable:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--apply wants module:function, got {spec!r}")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
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
