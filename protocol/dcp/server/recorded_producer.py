"""A DCP producer that plays a recording back, sans-IO (`dcptool serve dcp --from CAPTURE`).

The handshake (HELLO, SASL, SELECT_BUCKET, DCP_OPEN, DCP_CONTROL, noops) is answered by the
built-in producer's connection (producer.ProducerConnection), used as it is: every client
frame that is not about vbuckets goes to it. This module answers what depends on the
recording: GET_ALL_VB_SEQNOS, GET_FAILOVER_LOG, STREAM_REQ, CLOSE_STREAM and BUFFER_ACK.

A stream request is answered from the recording, in this order of preference:
1. a recorded stream request with the same (flags, start, end, vbucket uuid, snapshot) for
   that vbucket (the next unused one first): its recorded answer (success with its failover
   log, ROLLBACK to its seqno, or its error status) and, on success, its recorded frames in
   recorded order, byte for byte except the opaque, ending as the recorded stream ended
   (stream end; a dropped connection, reproduced once every stream of the connection has
   sent all it had; or open when the recording stopped);
2. otherwise the stream-request decision of stream_request.py (RECORDED_RANGE) against the vbucket's last
   recorded failover log, and, without a rollback, the vbucket's recorded history (every
   successful stream of the recording, a later one cutting the history back to its start
   seqno) from the requested start seqno: a marker whose snapshot began at or before the
   start is re-sent starting at the start seqno, as a producer does for a resumed stream.

The recorded frames arrive already encoded (replay/playback_source.py reads the capture): this
module never sees Arrow. Pacing and faults count stream frames over all connections of
one model (like the producer's scenarios, each fault fires once). Time is an argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dcptool.protocol.dcp.server.producer import (
    PULL_LIMIT,
    STREAM_CHUNK,
    ProducerConnection,
    ServerModel,
    refusal,
)
from dcptool.protocol.dcp.server.stream_request import RECORDED_RANGE, decide, requested
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    SEQNO_INFINITY,
    Opcode,
    Status,
    StreamEndReason,
)
from dcptool.protocol.dcp.wire.frames import Frame, FrameParser
from dcptool.protocol.errors import ProtocolError

OP_MARKER = int(Opcode.DCP_SNAPSHOT_MARKER)
DEFAULT_STALL = 5.0
CORRUPT_MAGIC = 0x00   # neither a request nor a response magic: the consumer must refuse it


@dataclasses.dataclass
class RecordedStream:
    """One recorded stream request and what the server sent on it. Frame arrays are in
    recorded order: `data` holds the frames back to back, `offsets` has n+1 entries."""
    vbucket: int
    conn: int                                  # recorded connection, numbered over all captures
    request: tuple[int, int, int, int, int, int]   # flags, start, end, uuid, snap_start, snap_end
    status: int
    rollback_seqno: int | None = None
    failover_log: tuple[tuple[int, int], ...] = ()
    resp_mono: int = 0
    data: bytes = b""
    offsets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, np.int64))
    mono: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    order: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    opcode: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint8))
    seqno: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # -1: no by_seqno
    snap_start: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # -1: not a marker
    ended_by: str = "open"                     # "end", "disconnect" or "open"

    @property
    def frames(self) -> int:
        return len(self.offsets) - 1

    @property
    def body_end(self) -> int:
        """Frames before the recorded stream end (the end itself is last when present)."""
        n = self.frames
        return n - 1 if n and self.ended_by == "end" else n

    def frame(self, i: int) -> bytes:
        return self.data[self.offsets[i]:self.offsets[i + 1]]


@dataclasses.dataclass
class DcpRecording:
    """What a playback serves: the bucket name, the recorded stream requests per vbucket (in
    recorded order) and the GET_ALL_VB_SEQNOS answers of the recorded connections."""
    bucket: str
    streams: dict[int, list[RecordedStream]]
    vb_seqnos: list[dict[int, int]] = dataclasses.field(default_factory=list)
    failover_logs: dict[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    skipped: int = 0        # recorded stream frames left out: shorter than a header or than it says

    @property
    def frames(self) -> int:
        return sum(s.frames for ss in self.streams.values() for s in ss)


@dataclasses.dataclass(frozen=True)
class Faults:
    """Fault injection, counted in stream frames served over all connections (once each)."""
    disconnect_at: int | None = None
    stall_at: int | None = None
    stall_seconds: float = DEFAULT_STALL
    corrupt_at: int | None = None


class _Bucket:
    """What the handshake of producer.ProducerConnection needs of a bucket: its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.vbuckets: list[Any] = []
        self.num_vbuckets = 0


class _History:
    """A vbucket's history by the rule of the module docstring: (stream, first, last) pieces."""

    def __init__(self, streams: list[RecordedStream]):
        self.pieces: list[list[Any]] = []
        self.failover_log: tuple[tuple[int, int], ...] = ()
        self.last: RecordedStream | None = None
        for rs in streams:
            if rs.status != Status.SUCCESS:
                continue
            start = rs.request[1]
            kept = []
            for piece in self.pieces:
                s, a, b = piece
                cut = _first_item_above(s, a, b, start)
                if cut > a:
                    kept.append([s, a, cut])
            self.pieces = kept + [[rs, 0, rs.body_end]]
            self.failover_log = rs.failover_log
            self.last = rs

    def high(self) -> int:
        high = 0
        for s, a, b in self.pieces:
            seq = s.seqno[a:b]
            if len(seq):
                high = max(high, int(seq.max()))
        return high


def _first_item_above(s: RecordedStream, a: int, b: int, seqno: int) -> int:
    """Index of the first frame in [a, b) carrying a by_seqno above `seqno` (b if none)."""
    hits = np.nonzero(s.seqno[a:b] > seqno)[0]
    return a + int(hits[0]) if len(hits) else b


class PlaybackModel:
    """What all connections of one playback server share."""

    def __init__(self, recording: DcpRecording, users: dict[str, str] | None = None, *,
                 pace: float | None = None, faults: Faults | None = None, seed: int = 0):
        self.recording = recording
        self.pace = pace                   # None: as fast as the client reads; else speed factor
        self.faults = faults or Faults()
        self.handshake = ServerModel([_Bucket(recording.bucket)], users, None, seed)  # type: ignore[list-item]  # a name only
        self.buckets: dict[str, Any] = {}            # no live updates (ProducerServer's rate loop)
        self.users = self.handshake.users
        self.accepted = 0
        self.stream_frames = 0
        self.disconnect_done = self.stall_done = self.corrupt_done = False
        self.stall_until: float | None = None
        self._next_use: dict[int, int] = {}
        self.current_log = {vb: (ss[0].failover_log if ss and ss[0].failover_log else ())
                            for vb, ss in recording.streams.items()}
        for vb, log in recording.failover_logs.items():
            if not self.current_log.get(vb):
                self.current_log[vb] = log
        self.history = {vb: _History(ss) for vb, ss in recording.streams.items()}
        self.disconnects: dict[int, set[int]] = {}   # recorded conn -> its streams cut by the drop
        for ss in recording.streams.values():
            for rs in ss:
                if rs.ended_by == "disconnect":
                    self.disconnects.setdefault(rs.conn, set()).add(id(rs))
        self.stats = self.handshake.stats   # bounded (shared.STATS_KEPT); the inner connection adds them

    def connect(self, now: float) -> "PlaybackConnection":
        self.accepted += 1
        return PlaybackConnection(self, now, self.accepted)

    def vb_seqnos(self, conn_no: int) -> dict[int, int]:
        """GET_ALL_VB_SEQNOS for the playback's n-th connection: the recorded n-th answer
        (the last one for later connections), for the vbuckets the recording has."""
        rec = self.recording
        answer = rec.vb_seqnos[min(conn_no, len(rec.vb_seqnos)) - 1] if rec.vb_seqnos else {}
        out = {}
        for vb in sorted(set(rec.streams) | set(rec.failover_logs)):
            out[vb] = answer[vb] if vb in answer else self.history[vb].high() if vb in self.history else 0
        return out

    def match(self, vb: int, request: tuple[int, ...]) -> RecordedStream | None:
        """The recorded stream request equal to `request`: the next unused one first."""
        streams = self.recording.streams.get(vb, [])
        first = self._next_use.get(vb, 0)
        for i in list(range(first, len(streams))) + list(range(0, min(first, len(streams)))):
            if streams[i].request == request:
                self._next_use[vb] = i + 1
                return streams[i]
        return None


class _Served:
    """A stream being served: pieces of recorded frames, then optional extra frames."""
    __slots__ = ("vb", "opaque", "pieces", "tail", "opened", "anchor", "ended_by")

    def __init__(self, vb: int, opaque: int, pieces: list[list[Any]], tail: list[bytes], opened: float,
                 ended_by: str) -> None:
        self.vb, self.opaque, self.pieces, self.tail = vb, opaque, pieces, tail
        self.opened, self.ended_by = opened, ended_by
        self.anchor = None
        for s, a, b in pieces:
            if b > a:
                self.anchor = int(s.mono[a])
                break

    def next_order(self) -> int | None:
        while self.pieces and self.pieces[0][1] >= self.pieces[0][2]:
            self.pieces.pop(0)
        if self.pieces:
            s, a, _ = self.pieces[0]
            return int(s.order[a])
        return None

    @property
    def exhausted(self) -> bool:
        return self.next_order() is None and not self.tail


class PlaybackConnection:
    """One client connection of a playback server: receive(), pull(), tick(), like
    producer.ProducerConnection; `closed` is the reason once the server drops it."""

    def __init__(self, model: PlaybackModel, now: float, conn_id: int):
        self.model = model
        self.conn_id = conn_id
        self.inner = ProducerConnection(model.handshake, now, conn_id)
        self.stats = self.inner.stats
        self.parser = FrameParser()
        self.streams: dict[int, _Served] = {}
        self.outstanding = 0
        self._out: list[bytes] = []
        self._closed: str | None = None
        self.drop_after: int | None = None      # recorded connection whose drop is replayed
        self.served_disconnects: set[int] = set()
        self.next_due: float | None = None

    @property
    def closed(self) -> str | None:
        return self._closed or self.inner.closed

    def close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        self.inner.close(reason)

    # ---- input
    def receive(self, data: bytes, now: float) -> None:
        if self.closed:
            return
        try:
            frames = self.parser.feed(data)
        except ProtocolError as exc:
            for fr in getattr(exc, "frames", []):
                self._handle(fr, now)
            self.close(f"bad frame: {exc.message}")
            return
        for fr in frames:
            if self.closed:
                return
            self._handle(fr, now)

    def _reply(self, req: Any, status: int = Status.SUCCESS, cls: Any = None, **kw: Any) -> None:
        if cls is None:
            msg = m.Response(opcode=req.op_code, opaque=req.opaque, status=status)
        else:
            msg = cls(opaque=req.opaque, status=status, **kw)
        self._out.append(m.encode(msg))

    def _handle(self, fr: Frame, now: float) -> None:
        msg: Any = m.decode(fr, self.inner.collections)
        t = type(msg)
        if msg.IS_RESPONSE or t not in (m.StreamRequest, m.GetFailoverLog, m.GetAllVbSeqnos, m.CloseStream,
                                        m.BufferAck):
            self.inner.receive(fr.raw, now)
            self._out.extend(self.inner.pull(now))
            return
        if t is m.BufferAck:
            self.outstanding = max(0, self.outstanding - msg.bytes_acked)
            self.stats["acked"] += msg.bytes_acked
            return
        if self.model.users and self.inner.user is None:
            self._reply(msg, Status.EACCESS)
        elif self.inner.bucket is None:
            self._reply(msg, Status.NO_BUCKET)
        elif t is m.GetAllVbSeqnos:
            seqnos = self.model.vb_seqnos(self.conn_id)
            self._reply(msg, cls=m.GetAllVbSeqnosResponse, seqnos=tuple(seqnos.items()))
        elif not self.inner.dcp_open:
            self._reply(msg, Status.EINVAL)
        elif t is m.GetFailoverLog:
            log = self.model.current_log.get(msg.vbucket)
            if not log:
                self._reply(msg, Status.NOT_MY_VBUCKET)
            else:
                self._reply(msg, cls=m.FailoverLogResponse, failover_log=tuple(log))
        elif t is m.CloseStream:
            st = self.streams.pop(msg.vbucket, None)
            if st is None:
                self._reply(msg, Status.KEY_ENOENT)
                return
            self._reply(msg)
            if self.inner.controls.get("send_stream_end_on_client_close_stream") == "true":
                self._out.append(m.encode(m.StreamEnd(vbucket=msg.vbucket, opaque=st.opaque,
                                                      reason=StreamEndReason.CLOSED)))
        else:
            self._stream_request(msg, now)

    def _stream_request(self, req: Any, now: float) -> None:
        self.stats["stream_requests"] += 1
        model, vb = self.model, req.vbucket
        if vb not in model.recording.streams:
            self._reply(req, Status.NOT_MY_VBUCKET)
            return
        if vb in self.streams:
            self._reply(req, Status.KEY_EEXISTS)
            return
        request = (req.flags, req.start_seqno, req.end_seqno, req.vbucket_uuid, req.snap_start, req.snap_end)
        rs = model.match(vb, request)
        if rs is not None:
            if rs.status == Status.ROLLBACK:
                self.stats["rollbacks"] += 1
                self._reply(req, Status.ROLLBACK, cls=m.StreamRequestResponse, rollback_seqno=rs.rollback_seqno or 0)
            elif rs.status != Status.SUCCESS:
                self._reply(req, rs.status)
            else:
                model.current_log[vb] = rs.failover_log
                self._reply(req, cls=m.StreamRequestResponse, failover_log=tuple(rs.failover_log))
                st = _Served(vb, req.opaque, [[rs, 0, rs.frames]], [], now, rs.ended_by)
                st.anchor = rs.resp_mono if rs.frames else None
                self.streams[vb] = st
            return
        self._from_history(req, now)

    def _from_history(self, req: Any, now: float) -> None:
        model, vb = self.model, req.vbucket
        hist = model.history[vb]
        log = hist.failover_log or model.current_log.get(vb) or ()
        high = model.vb_seqnos(len(model.recording.vb_seqnos) or 1).get(vb, hist.high())
        r = requested(req, high, log[0][0] if log else 0)
        if r is None:
            self._reply(req, Status.ERANGE)
            return
        d = decide(req, r, failover_log=list(log), high=high, in_range=RECORDED_RANGE)
        no = refusal(req, d, self.stats)
        if no is not None:
            self._out.append(m.encode(no))
            return
        start, end = r.start, d.end
        self._reply(req, cls=m.StreamRequestResponse, failover_log=tuple(log))
        pieces: list[list[Any]] = []
        for s, a, b in hist.pieces:
            a2 = _first_item_above(s, a, b, start)
            b2 = _first_item_above(s, a, b, end) if end < SEQNO_INFINITY else b
            if a2 >= b2:
                continue
            if not pieces:   # the snapshot holding the first item: its marker, from `start` if need be
                markers = np.nonzero(s.opcode[a:a2] == OP_MARKER)[0]
                if len(markers):
                    k = a + int(markers[-1])
                    if s.snap_start[k] > start:
                        a2 = k
                    else:
                        first: Any = m.decode_bytes(s.frame(k))
                        marker = dataclasses.replace(first, snap_start=start)
                        pieces.append([_single(m.encode(marker), int(s.order[k]), int(s.mono[k])), 0, 1])
            pieces.append([s, a2, b2])
        tail = []
        ends = None
        if end != SEQNO_INFINITY and end <= high:
            ends = StreamEndReason.OK
        elif hist.last is not None and hist.last.ended_by == "end":
            last: Any = m.decode_bytes(hist.last.frame(hist.last.frames - 1))
            ends = last.reason
        if ends is not None:
            tail.append(m.encode(m.StreamEnd(vbucket=vb, opaque=req.opaque, reason=ends)))
        self.streams[vb] = _Served(vb, req.opaque, pieces, tail, now, "open")

    # ---- timers
    def tick(self, now: float) -> None:
        if not self.closed:
            self.inner.tick(now)

    def next_deadline(self) -> float | None:
        times = [t for t in (self.inner.next_deadline(), self.next_due, self.model.stall_until) if t is not None]
        return min(times) if times else None

    # ---- output
    def _due(self, st: _Served, s: RecordedStream, a: int, b: int, now: float) -> int:
        """Frames of s[a:b] due by `now` under --pace (all when pacing is off)."""
        pace = self.model.pace
        if pace is None or st.anchor is None:
            return b
        limit = st.anchor + (now - st.opened) * pace * 1e9
        return a + int(np.searchsorted(s.mono[a:b], limit, side="right"))

    def _due_time(self, st: _Served, mono: int) -> float:
        return st.opened + (mono - (st.anchor or 0)) / ((self.model.pace or 1.0) * 1e9)

    def pull(self, now: float, limit: int = PULL_LIMIT) -> list[bytes]:
        """Bytes to send now: replies first, then recorded frames in recorded order (the
        stream with the earliest next frame goes first), within flow control, --pace and
        the faults. An empty list means wait (input, an ack, or next_deadline())."""
        out = self._out + self.inner.pull(now)
        self._out = []
        if self.closed:
            return out
        model, faults = self.model, self.model.faults
        self.next_due = None
        if model.stall_until is not None:
            if now < model.stall_until:
                return out
            model.stall_until = None
        total = 0
        while total < limit:
            heads = []
            for vb, st in self.streams.items():
                o = st.next_order()
                if o is not None:
                    heads.append((o, vb))
                elif st.tail:
                    heads.append((-1, vb))
            heads.sort()
            if not heads:
                break
            order, vb = heads[0]
            st = self.streams[vb]
            if order < 0:   # only the stream end is left
                data = b"".join(_patch_opaque(fr, _ZERO, st.opaque) for fr in st.tail)
                st.tail = []
                del self.streams[vb]
                out.append(data)
                total += len(data)
                self._count(1, len(data))
                if self._fire(now):
                    break
                continue
            s, a, b = st.pieces[0]
            if len(heads) > 1 and heads[1][0] >= 0:   # up to the other streams' next frame
                b = a + max(1, int(np.searchsorted(s.order[a:b], heads[1][0], side="left")))
            due = self._due(st, s, a, b, now)
            if due <= a:
                self.next_due = self._due_time(st, int(s.mono[a]))
                break
            budget = STREAM_CHUNK if not self.inner.buffer_size else self.inner.buffer_size - self.outstanding
            budget = min(budget, STREAM_CHUNK, limit - total)
            if budget <= 0:
                self.stats["flow_blocked"] += 1
                break
            offs = s.offsets
            fit = int(np.searchsorted(offs[a + 1:due + 1], offs[a] + budget, side="right"))
            b = self._fault_cap(a, a + max(1, fit))
            data = _patch_opaque(s.data[offs[a]:offs[b]], offs[a:b] - offs[a], st.opaque)
            if (faults.corrupt_at is not None and not model.corrupt_done
                    and model.stream_frames <= faults.corrupt_at < model.stream_frames + (b - a)):
                model.corrupt_done = True
                hurt = bytearray(data)
                hurt[int(offs[a + faults.corrupt_at - model.stream_frames] - offs[a])] = CORRUPT_MAGIC
                data = bytes(hurt)
            st.pieces[0][1] = b
            out.append(data)
            total += len(data)
            self._count(b - a, len(data))
            if st.next_order() is None and not st.tail:
                if st.ended_by == "disconnect":
                    self.served_disconnects.add(id(s))
                    self.drop_after = s.conn
            if self._fire(now):
                break
        if self.drop_after is not None and not self.closed:
            waiting = model.disconnects.get(self.drop_after, set()) - self.served_disconnects
            if not waiting and not any(st.next_order() is not None or st.tail for st in self.streams.values()):
                self.close("the recorded connection ended here")
        self.stats["bytes_sent"] += sum(len(x) for x in out)
        return out

    def _fault_cap(self, a: int, b: int) -> int:
        model, faults = self.model, self.model.faults
        for at, done in ((faults.disconnect_at, model.disconnect_done), (faults.stall_at, model.stall_done),
                         (faults.corrupt_at, model.corrupt_done)):
            if at is not None and not done and model.stream_frames < at:
                b = min(b, a + at - model.stream_frames)
        return max(b, a + 1)

    def _count(self, frames: int, nbytes: int) -> None:
        self.model.stream_frames += frames
        self.stats["stream_frames"] += frames
        self.outstanding += nbytes
        if self.outstanding > self.stats["max_outstanding"]:
            self.stats["max_outstanding"] = self.outstanding

    def _fire(self, now: float) -> bool:
        """Faults whose frame count is reached; True when sending must stop now."""
        model, faults = self.model, self.model.faults
        if faults.disconnect_at is not None and not model.disconnect_done and model.stream_frames >= faults.disconnect_at:
            model.disconnect_done = True
            self.close(f"fault: disconnect after {faults.disconnect_at} frames")
            return True
        if faults.stall_at is not None and not model.stall_done and model.stream_frames >= faults.stall_at:
            model.stall_done = True
            model.stall_until = now + faults.stall_seconds
            self.next_due = model.stall_until
            return True
        return False

    @property
    def wants_write(self) -> bool:
        return bool(self._out)


def _single(frame: bytes, order: int, mono: int) -> RecordedStream:
    """A one-frame recording (a re-based snapshot marker)."""
    return RecordedStream(vbucket=0, conn=0, request=(0,) * 6, status=0, data=frame,
                          offsets=np.array([0, len(frame)], np.int64), mono=np.array([mono], np.int64),
                          order=np.array([order], np.int64), opcode=np.array([OP_MARKER], np.uint8),
                          seqno=np.array([-1], np.int64), snap_start=np.array([-1], np.int64))


_ZERO = np.zeros(1, np.int64)


def _patch_opaque(data: Any, starts: np.ndarray, opaque: int) -> bytes:
    """The frames in `data` (starting at `starts`) with their opaque set to `opaque`."""
    buf = np.frombuffer(bytearray(data), np.uint8)
    if len(starts):
        for i, byte in enumerate(opaque.to_bytes(4, "big")):
            buf[starts + 12 + i] = byte
    return buf.tobytes()
