"""The DCP consumer state machine, sans-IO: the handshake (handshake.py: HELLO, SASL,
SELECT_BUCKET, DCP_OPEN, DCP_CONTROL), stream requests with a bounded number in flight, the rollback loop,
per-vbucket failover logs and snapshots, noop answers, buffer acks, stream ends and the end
condition of `--to`.

Bytes in: `receive(buf, offsets, lengths, now)` with the whole frames of one read (or
`feed(data, now)`, which splits for you). Bytes out: `outgoing()` (a list of frames, so a
capture can record each one). Time is an argument; `check(now)` raises RemoteError(TIMEOUT)
when a request has had no answer for `timeout` seconds (every handshake step, stream
requests), and RemoteError(DEAD_CONNECTION) when a streaming connection has been silent for
twice the noop interval, or, when noops were refused, for max(2 x noop interval, timeout).

Every field from the peer is checked before it indexes anything: a stream message for a
vbucket outside 0-1023 is RemoteError(BAD_VBUCKET) (the caller has already recorded it).

Hot path: data frames (mutation, deletion, expiration, system event, seqno advanced) are
never decoded into messages: opcode, vbucket, opaque and by_seqno are read with one
struct.unpack_from at fixed offsets and only per-vbucket state is updated. Everything else
is rare and decoded fully with protocol.dcp.messages.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Callable

from dcptool.protocol.dcp import messages as m
from dcptool.protocol.dcp.columnar import be_uint as _be
from dcptool.protocol.dcp.constants import (SEQNO_INFINITY, Feature, Opcode, SnapshotFlag,
                                            Status, StreamEndReason, StreamRequestFlag, op_name,
                                            status_name, stream_end_reason_name)
from dcptool.protocol.dcp.frames import parse_frame, split_until_error
from dcptool.protocol.dcp.consumer_api import (DEFAULT_REOPEN, NUM_VB_SLOTS, ConfigReceived,
                                               ConsumerConfig, ControlRefused, Finished, Handoff,
                                               HandshakeComplete, NotMyVbucket, Rollback, ServerVbuckets,
                                               StreamEnded, StreamFailed, StreamOpened, VbState)
from dcptool.protocol.dcp.handshake import Handshake
from dcptool.protocol.errors import AuthRefused, ErrorCode, RemoteError

# the consumer's API is importable from here (consumer_api.py holds the definitions)
__all__ = ["Consumer", "ConsumerConfig", "VbState", "DEFAULT_REOPEN", "NUM_VB_SLOTS", "ConfigReceived",
           "ControlRefused", "Finished", "Handoff", "HandshakeComplete", "NotMyVbucket", "Rollback",
           "ServerVbuckets", "StreamEnded", "StreamFailed", "StreamOpened"]

_DATA = struct.Struct(">BB4xH4xI8xQ")     # magic opcode . vbucket . opaque . by_seqno
DATA_OPS = frozenset({0x57, 0x58, 0x59, 0x5F, 0x64})
_DATA_OPS_ARRAY = sorted(DATA_OPS)
# DCP messages that belong to a vbucket's stream: one for a vbucket beyond NUM_VB_SLOTS makes
# the stream meaningless
STREAM_OPS = frozenset({0x55, 0x56, 0x57, 0x58, 0x59, 0x5B, 0x5F, 0x60, 0x62, 0x63, 0x64, 0x65})
_VECTOR_MIN = 48           # runs shorter than this take the per-frame loop


def _tolist(a):
    return a.tolist() if hasattr(a, "tolist") else list(a)

# per-vbucket phase
_WAIT, _FLOG, _REQ, _OPEN, _DONE = range(5)


class Consumer(Handshake):
    def __init__(self, config: ConsumerConfig, resume: dict[int, VbState] | None = None, now: float = 0.0):
        self.cfg = config
        # resume state comes from captures, which record whatever a server sent: a vbucket
        # id beyond what a bucket can have is no stream to resume
        self.states: dict[int, VbState] = {vb: dataclasses.replace(s, failover_log=list(s.failover_log))
                                           for vb, s in (resume or {}).items() if 0 <= vb < NUM_VB_SLOTS}
        self.features: tuple = ()
        self.controls: dict[str, str] = {}
        self.refused: dict[str, int] = {}
        self.should_pause: Callable[[], bool] | None = None
        self.phase = "hello"
        self.finished = False
        self.closing = False
        self._out: list[bytes] = []
        self._events: list = []
        self._pending: dict[int, Callable] = {}
        self._sent_at: dict[int, tuple[float, str]] = {}   # opaque -> (when, what) of a pending request
        self._unstamped: list[int] = []    # requests queued since the last stamp_sent()
        self._now = now
        self._sasl_rounds = 0
        self._opaque = 0
        self._tail = b""
        self.last_rx = now
        self.noop_active = False
        self.buffer_active = False
        self._unacked = 0
        self.acked_total = 0
        self.frames_in = 0
        self.data_frames = 0
        self.noops_answered = 0
        # per-vbucket arrays for the hot path
        self._last = [0] * NUM_VB_SLOTS
        self._sopq = [-1] * NUM_VB_SLOTS          # opaque of the open stream, -1 none
        for vb, st in self.states.items():
            self._last[vb] = st.last_seqno
        self._phase: dict[int, int] = {}
        self._queue: list[int] = []
        self._in_flight = 0
        self._reopens: dict[int, int] = {}
        self._rollbacks: dict[int, int] = {}
        self.vb_opaque: dict[int, int] = {}       # request opaque -> vbucket (for rows)
        self._sasl = None
        self._mech = None
        self._end_seqno: dict[int, int] = {}

    # ---- public
    def start(self, now: float) -> None:
        """Queue the first request (HELLO)."""
        self.last_rx = self._now = now
        feats = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.SNAPPY, Feature.DUPLEX,
                 Feature.TCP_NODELAY]
        if self.cfg.xattrs:
            feats.append(Feature.XATTR)
        if self.cfg.collections:
            feats.append(Feature.COLLECTIONS)
        self._request(m.Hello(agent=self.cfg.agent.encode(), features=tuple(int(f) for f in feats)),
                      self._on_hello)

    def outgoing(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def events(self) -> list:
        ev, self._events = self._events, []
        return ev

    @property
    def collections(self) -> bool:
        return Feature.COLLECTIONS in self.features

    def feed(self, data: bytes, now: float) -> list:
        """Convenience: split data (with any kept tail) into frames and receive them."""
        buf = self._tail + bytes(data)
        bounds, consumed, err = split_until_error(buf)
        self._tail = buf[consumed:]
        ev = self.receive(buf, [o for o, _ in bounds], [n for _, n in bounds], now)
        if err is not None:
            raise err
        return ev

    def resume_state(self) -> dict[int, VbState]:
        """Per-vbucket state to restart streams from on a new connection."""
        out = {}
        for vb, st in self.states.items():
            st.last_seqno = self._last[vb]
            st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
            out[vb] = dataclasses.replace(st, failover_log=list(st.failover_log))
        return out

    # ---- commands of a cluster session (transport/dcp_cluster.py)
    def adopt(self, vb: int, state: VbState) -> None:
        """Take over a vbucket's state (it moved here from another connection)."""
        if not 0 <= vb < NUM_VB_SLOTS:
            return      # resume state recorded from a hostile server: no stream to resume
        self.states[vb] = dataclasses.replace(state, failover_log=list(state.failover_log))
        self._last[vb] = state.last_seqno

    def add_vbuckets(self, states: dict[int, VbState]) -> None:
        """Stream these vbuckets too, from their states (a streaming connection, not finished)."""
        for vb, st in states.items():
            self.adopt(vb, st)
            if self.phase != "streaming":
                self.cfg = dataclasses.replace(self.cfg, vbuckets=[*(self.cfg.vbuckets or ()), vb])
                continue
            self._reopens.pop(vb, None)
            self._phase[vb] = _WAIT
            self._queue.append(vb)
        if self.phase == "streaming":
            self._pump()

    def take_states(self, vbuckets) -> dict[int, VbState]:
        """Give up these vbuckets (handed off, or their stream is to move): their states,
        current to the last seqno received. The connection forgets them."""
        out = {}
        for vb in vbuckets:
            st = self.states.pop(vb, None)
            if st is None:
                continue
            st.last_seqno = self._last[vb]
            st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
            out[vb] = st
            self._sopq[vb] = -1
            if self._phase.pop(vb, None) in (_FLOG, _REQ):
                self._in_flight -= 1     # its answer, when it comes, is ignored
            if vb in self._queue:
                self._queue.remove(vb)
        self._check_finished()
        return out

    def unfinished(self) -> list[int]:
        """The vbuckets this connection streams or will, whose stream has not ended or failed."""
        if self.phase != "streaming":
            return list(self.cfg.vbuckets or ())
        return [vb for vb, p in self._phase.items() if p != _DONE]

    def check(self, now: float) -> None:
        """Raise RemoteError(TIMEOUT) when a request has waited longer than the timeout for
        its answer, RemoteError(DEAD_CONNECTION) when a streaming connection is silent for
        longer than its idle limit (idle_limit())."""
        self._now = now
        timeout = self.cfg.timeout
        if timeout and self._sent_at:
            opaque, (sent, what) = min(self._sent_at.items(), key=lambda kv: kv[1][0])
            if now - sent > timeout:
                raise RemoteError(ErrorCode.TIMEOUT, f"no answer to {what} from the server within "
                                  f"{timeout:g} s (--timeout)")
        limit = self.idle_limit()
        if limit is not None and now - self.last_rx > limit:
            why = (f"noop interval {self.cfg.noop_interval:g} s" if self.noop_active else
                   f"the server refused noops: idle limit max(2 x noop interval, --timeout {timeout:g} s)")
            raise RemoteError(ErrorCode.DEAD_CONNECTION,
                              f"no frame from the producer for {now - self.last_rx:.1f} s ({why})")

    def idle_limit(self) -> float | None:
        """Seconds of silence after which a streaming connection is dead: 2x the noop
        interval when noops run; when the server refused them, max(2x interval, timeout);
        None before streaming and when the user turned noops off (--noop-interval 0)."""
        if self.phase != "streaming" or not self.cfg.noop_interval:
            return None
        if self.noop_active:
            return 2 * self.cfg.noop_interval
        return max(2 * self.cfg.noop_interval, self.cfg.timeout or 0.0) or None

    def next_check(self) -> float | None:
        limit = self.idle_limit()
        return None if limit is None else self.last_rx + limit

    def stamp_sent(self, now: float) -> None:
        """The requests queued since the last call left at `now` (after any long work such
        as SCRAM's PBKDF2, which must not count against the server's answer time)."""
        if self._unstamped:
            sent = self._sent_at
            for opaque in self._unstamped:
                if opaque in sent:
                    sent[opaque] = (now, sent[opaque][1])
            self._unstamped.clear()

    def hold(self, now: float) -> None:
        """We are holding reads back (flow control towards our writer): the silence and the
        waiting that follow are ours, so every clock restarts from now."""
        self.last_rx = self._now = now
        for opaque, (sent, what) in self._sent_at.items():
            if sent < now:
                self._sent_at[opaque] = (now, what)

    def close_streams(self) -> None:
        """Ask the producer to close every open stream (Ctrl-C, --max-messages)."""
        self.closing = True
        for vb, ph in self._phase.items():
            if ph == _OPEN:
                self._request(m.CloseStream(vbucket=vb), lambda f, vb=vb: None)

    def flush_acks(self, check_pause: bool = True) -> None:
        """Send the pending buffer ack if it is due and nothing asks us to pause."""
        if (self.buffer_active and self._unacked >= self.cfg.buffer_size * self.cfg.ack_ratio
                and not (check_pause and self.should_pause is not None and self.should_pause())):
            self._out.append(m.encode(m.BufferAck(bytes_acked=self._unacked)))
            self.acked_total += self._unacked
            self._unacked = 0

    # ---- receive
    def receive(self, buf, offsets, lengths, now: float) -> list:
        """Process the whole frames at offsets/lengths in buf. Returns the events.

        Long runs of data frames (a backfill) are applied column-wise: per vbucket the seqnos
        are checked to rise and the last one kept; every other frame, and any run that breaks
        a rule, goes through the per-frame path in wire order."""
        n = len(offsets)
        if n == 0:
            return self.events()
        self.last_rx = self._now = now
        self.frames_in += n
        if n < _VECTOR_MIN or not hasattr(offsets, "dtype"):
            self._receive_frames(buf, _tolist(offsets), _tolist(lengths), now)
        else:
            self._receive_vectorised(buf, offsets, lengths, now)
        self.flush_acks()
        return self.events()

    def _receive_vectorised(self, buf, offsets, lengths, now: float) -> None:
        import numpy as np
        n = len(offsets)
        u8 = np.frombuffer(buf, dtype=np.uint8)
        data = np.isin(u8[offsets + 1], _DATA_OPS_ARRAY) & (u8[offsets] == 0x80) & (lengths >= 32)
        idx = np.nonzero(data)[0]
        vbs = _be(u8, offsets[idx] + 6, 2).astype(np.int64)
        opq = _be(u8, offsets[idx] + 12, 4).astype(np.int64)
        # a vbucket id from the peer indexes nothing before it is checked: out-of-range ids
        # take the per-frame path, which reports them
        in_range = vbs < NUM_VB_SLOTS
        ok = in_range & (opq == np.asarray(self._sopq, dtype=np.int64)[np.where(in_range, vbs, 0)])
        # a run ends at every frame that is not a valid data frame
        stop = np.ones(n, dtype=bool)
        stop[idx[ok]] = False
        stops = np.nonzero(stop)[0].tolist()
        seqs = _be(u8, offsets[idx] + 24, 8)
        pos_in_idx = np.full(n, -1, dtype=np.int64)
        pos_in_idx[idx] = np.arange(len(idx))
        prev = 0
        for s in stops + [n]:
            if s > prev:
                self._apply_run(buf, offsets, lengths, prev, s, pos_in_idx, vbs, seqs, now)
            if s < n:
                self._receive_frames(buf, [int(offsets[s])], [int(lengths[s])], now)
            prev = s + 1

    def _apply_run(self, buf, offsets, lengths, a: int, b: int, pos_in_idx, vbs, seqs, now) -> None:
        import numpy as np
        if b - a < _VECTOR_MIN:
            self._receive_frames(buf, offsets[a:b].tolist(), lengths[a:b].tolist(), now)
            return
        sel = pos_in_idx[a:b]
        v = vbs[sel]
        q = seqs[sel].astype(np.int64)
        order = np.argsort(v, kind="stable")
        v_sorted, q_sorted = v[order], q[order]
        first = np.ones(len(v_sorted), dtype=bool)
        first[1:] = v_sorted[1:] != v_sorted[:-1]
        last = np.asarray(self._last, dtype=np.int64)
        rising = np.where(first, q_sorted > last[v_sorted], np.r_[True, q_sorted[1:] > q_sorted[:-1]])
        if not rising.all() or (seqs[sel] >= 1 << 63).any():
            self._receive_frames(buf, offsets[a:b].tolist(), lengths[a:b].tolist(), now)
            return
        ends = np.r_[np.nonzero(first)[0][1:] - 1, len(v_sorted) - 1]
        for vb, seq in zip(v_sorted[ends].tolist(), q_sorted[ends].tolist()):
            self._last[vb] = seq
        self._unacked += int(lengths[a:b].sum())
        self.data_frames += b - a

    def _receive_frames(self, buf, offsets: list, lengths: list, now: float) -> None:
        unpack = _DATA.unpack_from
        last = self._last
        sopq = self._sopq
        unacked = 0
        data = 0
        for i in range(len(offsets)):
            off = offsets[i]
            ln = lengths[i]
            op = buf[off + 1]
            if op in DATA_OPS and ln >= 32 and buf[off] == 0x80:
                _, _, vb, opaque, seq = unpack(buf, off)
                if vb < NUM_VB_SLOTS and opaque == sopq[vb] and seq > last[vb]:
                    last[vb] = seq
                    unacked += ln
                    data += 1
                    continue
            magic = buf[off]
            if (magic == 0x80 or magic == 0x08) and op != 0x5C:
                unacked += ln
            self._unacked += unacked
            unacked = 0
            self._slow(parse_frame(buf, off, ln), now)
        self._unacked += unacked
        self.data_frames += data

    def _slow(self, frame, now: float) -> None:
        msg = m.decode(frame, self.collections)
        if msg.IS_RESPONSE:
            handler = self._pending.pop(msg.opaque, None)
            self._sent_at.pop(msg.opaque, None)
            if handler is not None:
                handler(msg)
            return
        magic = frame.magic
        op = msg.op_code
        if magic == 0x82:   # server-initiated request (Duplex): acknowledge
            self._out.append(m.encode(m.Response(opcode=op, opaque=msg.opaque, magic=0x83)))
            return
        if op == 0x5C:
            self._out.append(m.encode(m.Response(opcode=0x5C, opaque=msg.opaque)))
            self.noops_answered += 1
            return
        vb = getattr(msg, "vbucket", None)
        if vb is not None and vb >= NUM_VB_SLOTS and op in STREAM_OPS:
            raise RemoteError(ErrorCode.BAD_VBUCKET,
                              f"{op_name(op)} for vbucket {vb} (opaque {msg.opaque}): vbucket ids go up to "
                              f"{NUM_VB_SLOTS - 1}; the stream cannot be trusted")
        if vb is None or vb >= NUM_VB_SLOTS or msg.opaque != self._sopq[vb]:
            return   # a frame of a stream we no longer have (closed, replaced, not ours): ignore
        t = type(msg)
        st = self.states[vb]
        if t is m.SnapshotMarker:
            st.last_seqno = self._last[vb]
            st.snap_start, st.snap_end = msg.snap_start, msg.snap_end
            st.snapshot_complete = st.last_seqno >= st.snap_end
            if msg.snap_flags & SnapshotFlag.ACK:
                self._out.append(m.encode(m.Response(opcode=0x56, opaque=msg.opaque)))
        elif t is m.StreamEnd:
            self._stream_end(vb, msg.reason)
        elif t is m.SetVbucketState:
            self._out.append(m.encode(m.Response(opcode=0x5B, opaque=msg.opaque)))
        elif op in DATA_OPS or t in (m.Prepare, m.Commit, m.Abort):
            seq = getattr(msg, "by_seqno", None)
            if seq is None:
                seq = getattr(msg, "commit_seqno", None) or getattr(msg, "abort_seqno", None)
            if seq is not None:
                if seq <= self._last[vb]:
                    raise RemoteError(ErrorCode.UNEXPECTED_MESSAGE,
                                      f"vbucket {vb}: seqno {seq} after {self._last[vb]}")
                self._last[vb] = seq
        elif getattr(msg, "decode_error", None) and op in DATA_OPS:
            raise RemoteError(ErrorCode.BAD_EXTRAS, f"vbucket {vb}: {msg.decode_error}")

    # ---- requests and handshake
    def _request(self, msg, handler) -> int:
        self._opaque += 1
        opaque = self._opaque
        msg = dataclasses.replace(msg, opaque=opaque)
        self._pending[opaque] = handler
        try:
            what = Opcode(msg.op_code).name
        except ValueError:
            what = op_name(msg.op_code)
        if type(msg) is m.StreamRequest or type(msg) is m.GetFailoverLog:
            what += f" (vbucket {msg.vbucket})"
        elif type(msg) is m.Control:
            what += f" {msg.key.decode()}"
        self._sent_at[opaque] = (self._now, what)
        self._unstamped.append(opaque)
        if hasattr(msg, "vbucket"):
            self.vb_opaque[opaque] = msg.vbucket
        self._out.append(m.encode(msg))
        return opaque

    # ---- streams
    def _start_streams(self) -> None:
        for vb in self.cfg.vbuckets or ():
            st = self.states.get(vb)
            if st is not None and st.ended_reason is not None:
                continue
            if st is None:
                self.states[vb] = VbState()
            self._phase[vb] = _WAIT
            self._queue.append(vb)
        self._pump()
        self._check_finished()

    def _pump(self) -> None:
        while self._queue and self._in_flight < self.cfg.max_in_flight and not self.closing:
            vb = self._queue.pop(0)
            self._in_flight += 1
            self._send_stream_req(vb)

    def _fresh(self, vb: int) -> bool:
        st = self.states[vb]
        return not st.failover_log and st.last_seqno == 0

    def _send_stream_req(self, vb: int) -> None:
        st = self.states[vb]
        cfg = self.cfg
        flags = 0
        if self._fresh(vb):
            if cfg.start == "now":
                flags |= StreamRequestFlag.FROM_LATEST
                start = uuid = ss = se = 0
            elif cfg.start not in ("0", "") and int(cfg.start) > 0 and not st.failover_log:
                self._phase[vb] = _FLOG   # a start seqno needs the branch it belongs to
                self._request(m.GetFailoverLog(vbucket=vb), lambda rsp, vb=vb: self._on_flog(vb, rsp))
                return
            else:
                start = uuid = ss = se = 0
        else:
            start, uuid, ss, se = st.request_seqnos()
        if cfg.to == "now":
            flags |= StreamRequestFlag.TO_LATEST
            end = SEQNO_INFINITY
        elif cfg.to == "forever":
            end = SEQNO_INFINITY
        else:
            end = int(cfg.to)
            if start >= end and not flags & StreamRequestFlag.FROM_LATEST:
                self._in_flight -= 1
                self._events.append(StreamEnded(vb, StreamEndReason.OK, True))
                self._finish_vb(vb, StreamEndReason.OK)
                return
        self._phase[vb] = _REQ
        self._end_seqno[vb] = end
        req = m.StreamRequest(vbucket=vb, flags=int(flags), start_seqno=start, end_seqno=end,
                              vbucket_uuid=uuid, snap_start=ss, snap_end=se)
        self._request(req, lambda rsp, vb=vb, start=start: self._on_stream_rsp(vb, start, rsp))

    def _on_flog(self, vb: int, rsp) -> None:
        if vb not in self._phase:
            return      # given up meanwhile
        st = self.states[vb]
        if rsp.status == Status.NOT_MY_VBUCKET and self.cfg.handoff:
            self._in_flight -= 1
            self._not_mine(vb, rsp)
            return
        if rsp.status != Status.SUCCESS or not rsp.failover_log:
            self._in_flight -= 1
            self._stream_failed(vb, rsp.status)
            self._pump()
            return
        want = int(self.cfg.start)
        st.failover_log = list(rsp.failover_log)
        st.last_seqno = self._last[vb] = want
        st.snap_start = st.snap_end = want
        st.snapshot_complete = True
        self._send_stream_req(vb)

    def _not_mine(self, vb: int, rsp) -> None:
        self._events.append(NotMyVbucket(vb, bytes(getattr(rsp, "value", b"") or b"")))
        self._phase[vb] = _WAIT     # until the caller takes it (take_states)
        self._pump()

    def _on_stream_rsp(self, vb: int, start: int, rsp) -> None:
        if vb not in self._phase:
            return      # given up meanwhile
        st = self.states[vb]
        status = rsp.status
        if status == Status.NOT_MY_VBUCKET and self.cfg.handoff:
            self._in_flight -= 1
            self._not_mine(vb, rsp)
            return
        if status == Status.SUCCESS or status == Status.KEY_EEXISTS:
            if rsp.failover_log is not None:
                st.failover_log = list(rsp.failover_log)
            self._in_flight -= 1
            self._phase[vb] = _OPEN
            self._sopq[vb] = rsp.opaque
            self._last[vb] = st.last_seqno = start
            self._events.append(StreamOpened(vb, start, tuple(st.failover_log)))
            self._pump()
            return
        if status == Status.ROLLBACK:
            r = rsp.rollback_seqno or 0
            n = self._rollbacks.get(vb, 0) + 1
            self._rollbacks[vb] = n
            if n > self.cfg.max_rollbacks:
                raise RemoteError(ErrorCode.STATUS, f"vbucket {vb}: more than {self.cfg.max_rollbacks} rollbacks",
                                  status)
            self._rollback(vb, r)
            self._events.append(Rollback(vb, r))
            self._send_stream_req(vb)
            return
        if status in (Status.EACCESS, Status.AUTH_ERROR):
            raise AuthRefused(f"stream request for vbucket {vb} denied: {status_name(status)}", status)
        if status in (Status.NOT_SUPPORTED, Status.EINVAL):
            raise RemoteError(ErrorCode.STATUS, f"stream request for vbucket {vb} refused: "
                              f"{status_name(status)}", status)
        self._in_flight -= 1
        self._stream_failed(vb, status)
        self._pump()

    def _rollback(self, vb: int, r: int) -> None:
        st = self.states[vb]
        st.failover_log = [e for e in st.failover_log if e[1] <= r]
        if r < self._last[vb] or not st.failover_log:
            self._last[vb] = r
        st.last_seqno = self._last[vb] = min(self._last[vb], r)
        st.snap_start = st.snap_end = st.last_seqno
        st.snapshot_complete = True

    def _stream_failed(self, vb: int, status: int) -> None:
        self._phase[vb] = _DONE
        self._events.append(StreamFailed(vb, status))
        self._check_finished()

    def _finish_vb(self, vb: int, reason: int) -> None:
        self._phase[vb] = _DONE
        self._sopq[vb] = -1
        st = self.states[vb]
        st.ended_reason = reason
        st.last_seqno = self._last[vb]
        self._check_finished()

    def _stream_end(self, vb: int, reason: int) -> None:
        st = self.states[vb]
        st.last_seqno = self._last[vb]
        st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
        self._sopq[vb] = -1
        if self.cfg.handoff and reason == StreamEndReason.STATE_CHANGED and not self.closing:
            self._events.append(StreamEnded(vb, reason, False))
            self._events.append(Handoff(vb, reason))
            self._phase[vb] = _WAIT     # until the caller takes it (take_states)
            return
        n = self._reopens.get(vb, 0)
        if reason in self.cfg.reopen_reasons and n < self.cfg.max_reopens and not self.closing:
            self._reopens[vb] = n + 1
            self._events.append(StreamEnded(vb, reason, False))
            self._phase[vb] = _WAIT
            self._queue.append(vb)
            self._pump()
            return
        self._events.append(StreamEnded(vb, reason, True))
        self._finish_vb(vb, reason)

    def _check_finished(self) -> None:
        if self.finished or self.phase != "streaming":
            return
        if all(p == _DONE for p in self._phase.values()):
            self.finished = True
            failed = sum(1 for vb in self._phase if self.states[vb].ended_reason is None)
            self._events.append(Finished(len(self._phase) - failed, failed))

    # ---- introspection
    def open_streams(self) -> int:
        return sum(1 for p in self._phase.values() if p == _OPEN)

    def last_seqno(self, vb: int) -> int:
        return self._last[vb]

    def describe_end(self, reason: int) -> str:
        return stream_end_reason_name(reason)
