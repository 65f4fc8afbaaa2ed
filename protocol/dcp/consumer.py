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

The receive path (the hot path for data frames, and server requests such as cluster-map
change notifications) is consumer_receive.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dcptool.protocol.dcp import messages as m
from dcptool.protocol.dcp.constants import (SEQNO_INFINITY, Feature, Opcode, Status, StreamEndReason,
                                            StreamRequestFlag, op_name, status_name, stream_end_reason_name)
from dcptool.protocol.dcp.frames import split_until_error
from dcptool.protocol.dcp.consumer_api import (DEFAULT_REOPEN, NUM_VB_SLOTS, ConfigReceived,
                                               ConsumerConfig, ControlRefused, Finished, Handoff,
                                               HandshakeComplete, NotMyVbucket, Rollback, ServerVbuckets,
                                               StreamEnded, StreamFailed, StreamOpened, VbState)
from dcptool.protocol.dcp.consumer_receive import (DATA_OPS, STREAM_OPS, ConfigPushed, PushIgnored,
                                                   Receiver)
from dcptool.protocol.dcp.handshake import Handshake
from dcptool.protocol.errors import AuthRefused, ErrorCode, RemoteError

# the consumer's API is importable from here (consumer_api.py holds the definitions)
__all__ = ["Consumer", "ConsumerConfig", "VbState", "DEFAULT_REOPEN", "NUM_VB_SLOTS", "ConfigReceived",
           "ControlRefused", "Finished", "Handoff", "HandshakeComplete", "NotMyVbucket", "Rollback",
           "ServerVbuckets", "StreamEnded", "StreamFailed", "StreamOpened", "ConfigPushed", "PushIgnored",
           "DATA_OPS", "STREAM_OPS"]

# per-vbucket phase
_WAIT, _FLOG, _REQ, _OPEN, _DONE = range(5)


class Consumer(Handshake, Receiver):
    # HELLO asks for these with Duplex: the server pushes each new cluster map (0x0d, whole)
    NOTIFY_FEATURES: tuple = (Feature.CLUSTERMAP_CHANGE_NOTIFICATION,)

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
                 Feature.TCP_NODELAY, *self.NOTIFY_FEATURES]
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
                              vbucket_uuid=uuid, snap_start=ss, snap_end=se, value=self.stream_value)
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
