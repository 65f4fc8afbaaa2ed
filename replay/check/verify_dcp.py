"""The DCP checks of `dcptool verify`, per vbucket and stream id, in replay order.

The items (mutations, deletions, expirations and every other frame with a `by_seqno`) are
checked a chunk at a time with numpy: each item is compared with the previous item of its
stream (seqnos strictly increase) and with the state the last control frame before it left
(the stream is open on this connection; the item lies in the current marker's range). The
control frames (stream requests and their answers, markers, OSO snapshots, stream ends) are
few; they run through `_Stream`, one at a time, and set that state:

* a stream request that follows an earlier stream of the vbucket must start at the last
  seqno received (above it: a gap; below it: a rewind; right after a ROLLBACK anywhere at or
  below its seqno: a consumer goes back to the end of a whole snapshot, PROTOCOLS.md), with
  its start inside its snapshot range and a vbucket uuid from the failover log received;
* a ROLLBACK answer must name a seqno the request and the failover log allow (kv_engine's
  rule, DCP_DIGEST §6.2): at most the requested start, and, when the request's uuid is in
  the failover log, not below that entry's seqno (0 excepted) nor above the seqno where its
  history ended (the next newer entry); otherwise it is a forged rollback;
* markers have snap_start <= snap_end and never overlap or go back; the first one after a
  request may re-cover the snapshot the request named;
* stream ends carry a known reason; an OSO snapshot start is followed by its end, not by a
  snapshot marker, another start or a stream end with reason OK. A stream closed, dropped or
  re-requested inside an OSO snapshot is no problem: the position stays at the seqno before
  its start (REPLAY.md), so the next request must start there; so is a capture that ends
  inside one (as inside any snapshot)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.protocol.dcp.wire.constants import Status, StreamEndReason
from dcptool.protocol.text import ranges_text
from dcptool.replay.check.findings import Finding, Findings, Where
from dcptool.replay.rules.columns import as_numpy, lookup_codes

SEQNO_OPS = {"mutation", "deletion", "expiration", "prepare", "commit", "abort", "system_event",
             "seqno_advanced"}
KNOWN_REASONS = {int(r) for r in StreamEndReason}
NONE = np.iinfo(np.int64).min
HEADER = 24         # bytes of a memcached frame header
# what an item's stream is doing when it arrives
CLOSED, NO_MARKER, IN_MARKER, IN_OSO, UNKNOWN = 0, 1, 2, 3, 4
OSO_START, OSO_END = 0x01, 0x02
CTRL_COLUMNS = ["frame_no", "conn", "direction", "op", "status", "vbucket", "opaque", "stream_id",
                "snap_start", "snap_end", "stream_end_reason", "rollback_seqno", "failover_log",
                "req_start_seqno", "req_vbucket_uuid", "req_snap_start", "req_snap_end"]


class _Stream:
    """One vbucket (and stream id) as verify follows it."""
    __slots__ = ("vb", "sid", "last", "open", "conn", "marker", "marker_frame", "first_marker",
                 "oso", "oso_max", "unknown", "log", "req", "streamed", "last_frame", "rolled_back")

    def __init__(self, vb: int, sid: int | None):
        self.vb, self.sid = vb, sid
        self.last = NONE            # last seqno received (or the start of the request after it)
        self.open = False
        self.conn = -1              # (capture rank << 32) | conn of the open stream
        self.marker: tuple[int, int] | None = None
        self.marker_frame = None
        self.first_marker = False
        self.oso: tuple[Where, int] | None = None   # (where, frame) of an OSO start without its end yet
        self.oso_max = NONE
        self.unknown = False        # rows were lost: judge nothing until the next control frame
        self.log: list[tuple[int, int]] = []   # failover log received, newest first
        self.req: dict | None = None           # the last stream request sent
        self.streamed = False       # a stream of this vbucket was requested before
        self.last_frame = None
        self.rolled_back = False    # the last answer was a ROLLBACK: the next request may start below

    def mode(self) -> int:
        if self.unknown:
            return UNKNOWN
        if not self.open:
            return CLOSED
        if self.oso is not None:
            return IN_OSO
        return NO_MARKER if self.marker is None else IN_MARKER


@dataclasses.dataclass
class _Chunk:
    """The rows of one chunk that verify looks at, grouped by stream (DcpChecker.feed)."""
    order: np.ndarray       # row numbers, sorted by stream, in order within each
    k: np.ndarray           # each one's stream key
    idx: np.ndarray         # 0 .. len(order) - 1
    is_item: np.ndarray     # an item (else a control frame)
    seq: np.ndarray         # its by_seqno
    new_group: np.ndarray   # the first row of its stream
    gstart: np.ndarray      # the position of its stream's first row
    inv: np.ndarray         # the index of its stream in `states`
    states: list            # the _Stream of each stream
    before: tuple           # per row, its stream before the chunk: last, mode, conn, marker lo, hi


class DcpChecker:
    COLUMNS = ["capture_id", *CTRL_COLUMNS, "by_seqno", "decode_error"]

    def __init__(self):
        self.streams: dict[int, _Stream] = {}
        self.sid_of: dict[tuple[int, int], int] = {}   # (conn id, opaque) -> stream id of a request
        self.no_raw: set[str] = set()                   # files reported without raw

    # ---------------------------------------------------------------------------- driver API
    def resync(self) -> None:
        """Rows were lost before what comes next: forget snapshot and stream state (seqnos
        must still increase)."""
        for s in self.streams.values():
            s.unknown = True
            s.marker = None
            s.oso = None

    def retained(self, vbuckets: dict) -> None:
        """A retention ring deleted the head of the capture (its record's `vbuckets`: the state
        after it): those streams were open, in a state to take from the frames that follow,
        and their seqnos continue above the last one deleted."""
        for vb, d in vbuckets.items():
            for sid, x in ((d.get("streams") or {}).items() or [(None, d)]):
                s = self._stream(int(vb) | ((0 if sid is None else int(sid) + 1) << 16))
                s.unknown, s.open, s.streamed = True, True, True
                s.last = max(s.last, int(x.get("last_seqno") or 0))
                s.log = [(int(u), int(q)) for u, q in x.get("failover_log") or ()]

    def finish(self, out: Findings) -> None:
        """Nothing to report at the end: a capture may stop inside any snapshot, OSO too."""

    def feed(self, t: pa.Table, raw, where: Where, out: Findings) -> None:
        if t.num_rows == 0:
            return
        fn = as_numpy(t.column("frame_no"), fill=0, dtype=np.int64)
        self._check_raw(raw, fn, t.column("vbucket"), where, out)
        err = self._decode_errors(t, fn, where, out)
        item, ctrl, is_out, m_req, m_oso = self._select(t, err)
        rel = np.flatnonzero(item | ctrl)
        if len(rel) == 0:
            return
        conn = as_numpy(t.column("conn"), fill=0, dtype=np.int64) | (where.rank << 32)
        vb = as_numpy(t.column("vbucket"), fill=0, dtype=np.int64)
        sid = self._stream_ids(t, ctrl & m_req, is_out, conn)
        g = self._group(t, rel, item, sid, vb)
        post = self._controls(t, raw, g, m_oso, conn, where, out)
        last_ctrl = self._absorb_tails(g)
        if not g.is_item.any():      # the items, all at once
            return
        self._judge_items(g, post, last_ctrl, conn[g.order], where, out,
                          fn=fn, vb=vb, sids=sid[g.order])

    # ---------------------------------------------------------------------------- feed's steps
    @staticmethod
    def _decode_errors(t: pa.Table, fn: np.ndarray, where: Where, out: Findings) -> np.ndarray:
        err = as_numpy(t.column("decode_error").is_valid(), dtype=bool)
        if err.any():
            msgs, vbs = t.column("decode_error"), t.column("vbucket")
            for i in np.flatnonzero(err).tolist():
                out.at(where, "dcp.decode_error", f"frame did not decode: {msgs[i].as_py()}",
                       frame_no=int(fn[i]), vbucket=vbs[i].as_py())
        return err

    @staticmethod
    def _select(t: pa.Table, err: np.ndarray):
        """The rows verify looks at: items received, and the control frames (markers, OSO
        snapshots, stream ends, answers to stream requests and failover logs, requests sent)."""
        is_in, is_out = lookup_codes(t.column("direction"), {"in"}, {"out"})
        m_seq, m_marker, m_oso, m_end, m_req, m_gfl = lookup_codes(
            t.column("op"), SEQNO_OPS, {"snapshot_marker"}, {"oso_snapshot"}, {"stream_end"},
            {"stream_req"}, {"get_failover_log"})
        ok = as_numpy(t.column("vbucket").is_valid(), dtype=bool) & ~err
        has_status = as_numpy(t.column("status").is_valid(), dtype=bool)
        item = is_in & m_seq & ~has_status & ok & as_numpy(t.column("by_seqno").is_valid(), dtype=bool)
        ctrl = ok & ((is_in & ~has_status & (m_marker | m_oso | m_end))
                     | (is_in & has_status & (m_req | m_gfl))
                     | (is_out & m_req & ~has_status))
        return item, ctrl, is_out, m_req, m_oso

    def _stream_ids(self, t: pa.Table, req_mask: np.ndarray, is_out: np.ndarray, conn: np.ndarray) -> np.ndarray:
        """Each row's stream id (-1: none). Answers to stream requests carry no stream id:
        they take the request's (by connection and opaque)."""
        sid = as_numpy(t.column("stream_id").cast(pa.int64()), fill=-1, dtype=np.int64).copy()   # written below
        req_rows = np.flatnonzero(req_mask)
        if len(req_rows) and (sid >= 0).any():
            opq = as_numpy(t.column("opaque"), fill=0, dtype=np.int64)
            for i in req_rows.tolist():
                k = (int(conn[i]), int(opq[i]))
                if is_out[i]:
                    self.sid_of[k] = int(sid[i])
                elif sid[i] < 0:
                    sid[i] = self.sid_of.get(k, -1)
        return sid

    def _group(self, t: pa.Table, rel: np.ndarray, item: np.ndarray, sid: np.ndarray, vb: np.ndarray) -> _Chunk:
        """The rows looked at, grouped by stream (in order within each), and the state each
        stream had before this chunk (the control frames change it)."""
        key = ((sid + 1) << 16) | vb
        order = rel[np.argsort(key[rel], kind="stable")]
        k = key[order]
        m = len(order)
        idx = np.arange(m)
        new_group = np.ones(m, bool)
        new_group[1:] = k[1:] != k[:-1]
        uniq, inv = np.unique(k, return_inverse=True)
        inv = inv.reshape(-1)
        states = [self._stream(int(u)) for u in uniq.tolist()]
        before = (np.array([s.last for s in states], np.int64)[inv],
                  np.array([s.mode() for s in states], np.int64)[inv],
                  np.array([s.conn for s in states], np.int64)[inv],
                  np.array([s.marker[0] if s.marker else 0 for s in states], np.int64)[inv],
                  np.array([s.marker[1] if s.marker else -1 for s in states], np.int64)[inv])
        return _Chunk(order=order, k=k, idx=idx, is_item=item[order],
                      seq=as_numpy(t.column("by_seqno"), fill=0, dtype=np.int64)[order], new_group=new_group,
                      gstart=np.maximum.accumulate(np.where(new_group, idx, 0)), inv=inv, states=states,
                      before=before)

    def _controls(self, t: pa.Table, raw, g: _Chunk, m_oso: np.ndarray, conn: np.ndarray, where: Where,
                  out: Findings) -> tuple:
        """The control frames, one at a time, each stream in order (the items before each
        absorbed first). Returns the state after each: last, mode, conn, marker lo, hi."""
        m = len(g.order)
        post_last = np.full(m, NONE, np.int64)
        post_mode = np.zeros(m, np.int64)
        post_conn = np.full(m, -1, np.int64)
        post_lo = np.zeros(m, np.int64)
        post_hi = np.full(m, -1, np.int64)
        cpos = np.flatnonzero(~g.is_item)
        if len(cpos):
            order, k, gstart, seq = g.order, g.k, g.gstart, g.seq
            rows = t.take(pa.array(order[cpos])).select(CTRL_COLUMNS).to_pydict()
            oso_flags = self._oso_flags(raw, order[cpos], m_oso[order[cpos]])
            seg_start = -1
            prev_key = None
            for j, p in enumerate(cpos.tolist()):
                s = g.states[g.inv[p]]
                if k[p] != prev_key:
                    prev_key, seg_start = k[p], gstart[p]
                if p > seg_start:
                    self._absorb(s, seq[seg_start:p])
                seg_start = p + 1
                self._control(s, {c: v[j] for c, v in rows.items()}, int(conn[order[p]]),
                              oso_flags[j], where, out)
                post_last[p], post_mode[p], post_conn[p] = s.last, s.mode(), s.conn
                if s.marker is not None:
                    post_lo[p], post_hi[p] = s.marker
        return post_last, post_mode, post_conn, post_lo, post_hi

    def _absorb_tails(self, g: _Chunk) -> np.ndarray:
        """The items after the last control frame of each stream; returns, per row, the
        position of the last control frame at or before it (-1: none)."""
        m = len(g.order)
        last_ctrl = np.maximum.accumulate(np.where(~g.is_item, g.idx, -1))
        gend = np.append(np.flatnonzero(g.new_group[1:]), m - 1)
        for e in gend.tolist():
            s = g.states[g.inv[e]]
            b = max(int(last_ctrl[e]) + 1, int(g.gstart[e]))
            if b <= e:
                self._absorb(s, g.seq[b:e + 1])
        return last_ctrl

    @staticmethod
    def _judge_items(g: _Chunk, post: tuple, last_ctrl: np.ndarray, i_conn: np.ndarray, where: Where,
                     out: Findings, *, fn: np.ndarray, vb: np.ndarray, sids: np.ndarray) -> None:
        """Each item against the previous item of its stream and the state the last control
        frame before it left (or the stream's state before the chunk)."""
        is_item, seq, m = g.is_item, g.seq, len(g.order)
        c_last, c_mode, c_conn, c_lo, c_hi = g.before
        post_last, post_mode, post_conn, post_lo, post_hi = post
        has_ctrl = last_ctrl >= g.gstart
        lc = np.maximum(last_ctrl, 0)
        mode = np.where(has_ctrl, post_mode[lc], c_mode)
        s_conn = np.where(has_ctrl, post_conn[lc], c_conn)
        lo = np.where(has_ctrl, post_lo[lc], c_lo)
        hi = np.where(has_ctrl, post_hi[lc], c_hi)
        prev_item = np.zeros(m, bool)
        prev_item[1:] = is_item[:-1] & ~g.new_group[1:]
        prev_seq = np.where(has_ctrl, post_last[lc], c_last)
        prev_seq[1:] = np.where(prev_item[1:], seq[:-1], prev_seq[1:])
        judged = is_item & (mode != IN_OSO)
        streaming = (mode == NO_MARKER) | (mode == IN_MARKER) | (mode == IN_OSO)
        no_stream = is_item & ((mode == CLOSED) | (streaming & (i_conn != s_conn)))
        not_inc = judged & (prev_seq != NONE) & (seq <= prev_seq)
        outside = is_item & ~no_stream & ((mode == NO_MARKER) | ((mode == IN_MARKER) & ((seq < lo) | (seq > hi))))
        bad = no_stream | not_inc | outside
        for p in np.flatnonzero(bad).tolist():
            i = g.order[p]
            loc = dict(frame_no=int(fn[i]), vbucket=int(vb[i]), stream_id=None if sids[p] < 0 else int(sids[p]),
                       seqno=int(seq[p]))
            if no_stream[p]:
                why = "no stream open" if mode[p] == CLOSED else "the stream was opened on another connection"
                out.at(where, "dcp.frame_without_stream", f"item seqno {seq[p]} of vbucket {vb[i]}: {why}", **loc)
            if not_inc[p]:
                out.at(where, "dcp.seqno_not_increasing", f"vbucket {vb[i]}: seqno {seq[p]} after "
                       f"{prev_seq[p]}", **loc)
            if outside[p]:
                rng = "before any snapshot marker" if mode[p] == NO_MARKER else \
                    f"outside snapshot [{lo[p]}, {hi[p]}]"
                out.at(where, "dcp.item_outside_snapshot", f"vbucket {vb[i]}: seqno {seq[p]} {rng}", **loc)

    # ---------------------------------------------------------------------------- state
    def _check_raw(self, raw, fn: np.ndarray, vbs, where: Where, out: Findings) -> None:
        """Playback sends the raw bytes: a file without them, and frames whose raw is shorter
        than a header or than the length its header says, are reported."""
        try:
            arr = raw()
        except (KeyError, pa.ArrowException):
            arr = None
        if arr is None or arr.null_count == len(arr):
            if where.file not in self.no_raw:
                self.no_raw.add(where.file)
                out.at(where, "dcp.raw_missing", "no `raw` column (the recorded frames): this capture "
                       "cannot be played back (serve dcp --from)", frame_no=int(fn[0]))
            return
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        lens = as_numpy(pc.binary_length(arr), fill=0, dtype=np.int64)
        whole = lens >= HEADER
        if whole.any():
            otype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
            offs = np.frombuffer(arr.buffers()[1], otype)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
            data = np.frombuffer(arr.buffers()[2], np.uint8)
            at = offs[:-1][whole]
            body = np.zeros(len(at), np.int64)
            for j in range(8, 12):
                body = (body << 8) | data[at + j]
            whole[whole] = lens[whole] == HEADER + body
        for i in np.flatnonzero(~whole).tolist():
            what = "shorter than a frame header" if lens[i] < HEADER else "not the length its header says"
            out.at(where, "dcp.raw_short", f"raw frame of {lens[i]} bytes, {what}: it cannot be played back",
                   frame_no=int(fn[i]), vbucket=vbs[i].as_py())

    def _stream(self, key: int) -> _Stream:
        s = self.streams.get(key)
        if s is None:
            sid = (key >> 16) - 1
            s = self.streams[key] = _Stream(key & 0xFFFF, None if sid < 0 else sid)
        return s

    @staticmethod
    def _absorb(s: _Stream, seqnos: np.ndarray) -> None:
        """Items of `s` between two control frames: the last one (in OSO: the highest)."""
        if s.oso is not None:
            s.oso_max = max(s.oso_max, int(seqnos.max()))
        else:
            s.last = int(seqnos[-1])

    @staticmethod
    def _oso_flags(raw, rows: np.ndarray, is_oso: np.ndarray) -> list:
        flags: list[int | None] = [None] * len(rows)
        if not is_oso.any():
            return flags
        col = raw()
        for j in np.flatnonzero(is_oso).tolist():
            b = col[int(rows[j])].as_py()
            if not b or len(b) < 24:
                continue
            framing = b[2] if b[0] in (0x08, 0x18) else 0
            at = 24 + framing
            if len(b) >= at + 4 and b[4] >= 4:
                flags[j] = int.from_bytes(b[at:at + 4], "big")
        return flags

    def _control(self, s: _Stream, r: dict, conn: int, oso_flags, where: Where, out: Findings) -> None:
        op, frame = r["op"], r["frame_no"]
        loc = dict(frame_no=frame, vbucket=s.vb, stream_id=s.sid)
        if r["direction"] == "out":
            self._request(s, r, conn, where, out, loc)
            return
        if r["status"] is not None:
            if op == "stream_req":
                self._answer(s, r, conn, where, out, loc)
            elif r["status"] == Status.SUCCESS and r["failover_log"]:
                s.log = [(e["vbucket_uuid"], e["seqno"]) for e in r["failover_log"]]
            return
        was_unknown = s.unknown
        if was_unknown:             # after lost rows: take the stream as the frames show it
            s.unknown, s.open, s.conn = False, True, conn
        elif not s.open or s.conn != conn:
            why = "no stream open" if not s.open else "the stream was opened on another connection"
            out.at(where, "dcp.frame_without_stream", f"{op} of vbucket {s.vb}: {why}", **loc)
        if op == "snapshot_marker":
            self._marker(s, r, where, out, loc, was_unknown)
        elif op == "oso_snapshot":
            if oso_flags is not None and oso_flags & OSO_START:
                if s.oso is not None:
                    out.at(s.oso[0], "dcp.oso_not_closed", f"OSO snapshot of vbucket {s.vb} started "
                           "again before its end", frame_no=s.oso[1], vbucket=s.vb, stream_id=s.sid)
                s.oso, s.oso_max = (where, frame), s.last
            elif oso_flags is not None and oso_flags & OSO_END:
                if s.oso is not None:
                    s.last = max(s.last, s.oso_max)
                s.oso = None
                s.marker = None
        elif op == "stream_end":
            reason = r["stream_end_reason"]
            if reason not in KNOWN_REASONS:
                out.at(where, "dcp.stream_end_unknown_reason", f"stream end of vbucket {s.vb} with "
                       f"reason {reason} (known: 0..{max(KNOWN_REASONS)})", **loc)
            # a stream that ends OK claims it sent everything: not inside an OSO snapshot
            self._close_oso(s, out, "the stream ended (reason 0, OK)" if reason == StreamEndReason.OK else None)
            s.open = False

    def _close_oso(self, s: _Stream, out: Findings, why: str | None) -> None:
        """The OSO snapshot of `s` is left without its end: it counts for nothing (the
        position stays at the seqno before its start). A finding when `why` says so."""
        if s.oso is not None:
            if why:
                out.at(s.oso[0], "dcp.oso_not_closed", f"OSO snapshot of vbucket {s.vb} not ended before {why}",
                       frame_no=s.oso[1], vbucket=s.vb, stream_id=s.sid)
            s.oso = None

    def _marker(self, s: _Stream, r: dict, where: Where, out: Findings, loc: dict, was_unknown: bool) -> None:
        lo, hi = r["snap_start"], r["snap_end"]
        if lo is None or hi is None:
            return
        self._close_oso(s, out, "the next snapshot marker")
        if lo > hi:
            out.at(where, "dcp.marker_bad_range", f"vbucket {s.vb}: snapshot [{lo}, {hi}] ends "
                   "before it starts", **loc)
        if s.marker is not None and not was_unknown:
            plo, phi = s.marker
            if lo <= phi:
                out.at(where, "dcp.marker_overlap", f"vbucket {s.vb}: snapshot [{lo}, {hi}] overlaps or "
                       f"goes back behind the previous [{plo}, {phi}]", **loc)
            elif s.last < phi:
                out.at(where, "dcp.snapshot_incomplete", f"vbucket {s.vb}: snapshot [{plo}, {phi}] "
                       f"ended at seqno {s.last if s.last != NONE else 'none'} before its end {phi}",
                       frame_no=s.marker_frame, vbucket=s.vb, stream_id=s.sid, seqno=None if s.last == NONE else s.last)
        s.marker, s.marker_frame, s.first_marker = (lo, hi), r["frame_no"], False

    def _request(self, s: _Stream, r: dict, conn: int, where: Where, out: Findings, loc: dict) -> None:
        start, uuid = r["req_start_seqno"], r["req_vbucket_uuid"]
        ss, se = r["req_snap_start"], r["req_snap_end"]
        if start is not None:
            loc = dict(loc, seqno=start)
            if s.streamed and not s.unknown and s.last != NONE:
                if start > s.last:
                    out.at(where, "dcp.resume_gap", f"vbucket {s.vb}: stream requested from seqno {start} "
                           f"but the last seqno received was {s.last}: {s.last + 1}..{start} never received", **loc)
                elif start < s.last and not s.rolled_back:
                    out.at(where, "dcp.resume_rewind", f"vbucket {s.vb}: stream requested from seqno {start} "
                           f"below the last seqno received {s.last}: {start + 1}..{s.last} come again", **loc)
            if ss is not None and se is not None and not ss <= start <= se:
                out.at(where, "dcp.resume_bad_snapshot", f"vbucket {s.vb}: start seqno {start} outside "
                       f"the requested snapshot [{ss}, {se}]", **loc)
            if s.log and start > 0 and uuid is not None and uuid not in {u for u, _ in s.log}:
                out.at(where, "dcp.unknown_vbucket_uuid", f"vbucket {s.vb}: stream requested with uuid "
                       f"{uuid:#x}, not in the failover log received ({len(s.log)} entries)", **loc)
        self._close_oso(s, out, None)     # abandoned: the new request starts it again
        s.rolled_back = False
        s.req = {"start": start, "uuid": uuid, "snap_start": ss, "snap_end": se, "log": list(s.log)}
        s.streamed, s.unknown, s.open = True, False, False
        s.marker, s.first_marker = None, True
        s.last = NONE if start is None else start
        s.conn = conn

    def _answer(self, s: _Stream, r: dict, conn: int, where: Where, out: Findings, loc: dict) -> None:
        status = r["status"]
        if status == Status.SUCCESS:
            s.open, s.conn, s.unknown = True, conn, False
            if r["failover_log"]:
                s.log = [(e["vbucket_uuid"], e["seqno"]) for e in r["failover_log"]]
            return
        s.open = False
        if status != Status.ROLLBACK or r["rollback_seqno"] is None:
            return
        rb = r["rollback_seqno"]
        why = self._forged(rb, s.req)
        if why:
            out.at(where, "dcp.forged_rollback", f"vbucket {s.vb}: ROLLBACK to seqno {rb} {why}",
                   **dict(loc, seqno=rb))
        if s.last == NONE or rb < s.last:
            s.last = rb
        s.rolled_back = True

    @staticmethod
    def _forged(rb: int, req: dict | None) -> str | None:
        """Why a rollback to `rb` cannot be the answer to `req`, or None."""
        if rb < 0:
            return "is negative"
        if req is None:
            return None
        start, uuid, log = req["start"], req["uuid"], req["log"]
        if start is not None and rb > start:
            return f"is above the requested start seqno {start}"
        if rb == 0 or not log or uuid is None:
            return None
        for i, (u, seqno) in enumerate(log):
            if u == uuid:
                if rb < seqno:
                    return (f"is below seqno {seqno} where failover entry {uuid:#x} (the request's) "
                            "begins")
                if i > 0 and rb > log[i - 1][1]:
                    return (f"is above seqno {log[i - 1][1]} where the history of failover entry "
                            f"{uuid:#x} ended")
                return None
        return None


def check_shards(files, checker: DcpChecker, out: Findings) -> None:
    """`capture --shard K/N` captures: the shards present must cover the bucket. The vbuckets
    of an absent shard are those with vb % N == K - 1 of the --vbuckets the shards were given,
    else of the bucket, whose vbucket count is the highest vbucket streamed rounded up to a
    power of two (64, 128, 1024)."""
    import json
    shards: dict[int, set[int]] = {}
    given: set[int] = set()
    for f in files:
        try:
            o = json.loads(f.metadata.get("dcptool.options") or "{}")
        except ValueError:
            continue
        shard = o.get("shard") if isinstance(o, dict) else None
        if not isinstance(shard, str) or "/" not in shard:
            continue
        k, n = (int(x) for x in shard.split("/"))
        shards.setdefault(n, set()).add(k)
        given.update(o.get("vbuckets") or ())
    if len(shards) > 1:
        out.add(Finding("dcp.shards_mixed", "shards of different counts in one capture set: "
                        + ", ".join(f"{sorted(ks)} of {n}" for n, ks in sorted(shards.items()))))
        return
    for n, ks in shards.items():
        absent = [k for k in range(1, n + 1) if k not in ks]
        if not absent:
            return
        seen = {s.vb for s in checker.streams.values()}
        count = 1 << max(seen).bit_length() if seen else 0
        universe = sorted(given) if given else range(count)
        missing = [vb for vb in universe if vb % n + 1 in absent]
        names = ", ".join(f"{k}/{n}" for k in absent)
        out.add(Finding("dcp.shard_missing", f"shard {names} absent: vbuckets {ranges_text(missing) or 'none'} not captured"
                        f" ({len(missing)} of {len(universe)})"))


