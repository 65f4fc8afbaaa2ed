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

Streams are keyed by consumer_api.stream_key(vbucket, stream id): the vbucket itself without
stream ids; with them (enable_stream_id) one stream per vbucket and group, sids 1..n, each with
its own state, filter and opaque. What goes in and out (resume, adopt, take_states,
resume_state, vb_states) stays per vbucket: a VbState whose `streams` holds the per-sid states.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.client import manifest as dcp_collections
from dcptool.protocol.dcp.wire.constants import (SEQNO_INFINITY, Feature, FrameInfoId, Opcode, Status, StreamEndReason,
                                            StreamRequestFlag, op_name, status_name, stream_end_reason_name)
from dcptool.protocol.dcp.wire.frames import split_until_error
from dcptool.protocol.dcp.client.consumer_api import (DEFAULT_REOPEN, NUM_VB_SLOTS, ConfigReceived,
                                               ConsumerConfig, ControlRefused, Finished, Handoff,
                                               HandshakeComplete, NotMyVbucket, Rollback, ServerVbuckets,
                                               StreamEnded, StreamFailed, StreamOpened, VbState, key_sid, key_vb,
                                               stream_key)
from dcptool.protocol.dcp.client.consumer_receive import (DATA_OPS, STREAM_OPS, ConfigPushed, PushIgnored,
                                                   Receiver)
from dcptool.protocol.dcp.client.handshake import Handshake
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
        # stream ids: one per group (sid 1..n), or 0 = none
        groups = len(config.stream_filters if config.stream_filters is not None else config.stream_groups)
        self.sids: tuple = tuple(range(1, max(1, groups) + 1)) if config.stream_ids else (0,)
        self._sid_filters: dict[int, dict | None] = {}
        if config.stream_ids and config.stream_filters is not None:
            self._sid_filters = {i + 1: (dict(f) if f else None) for i, f in enumerate(config.stream_filters)}
        # per stream key (stream_key(vb, sid)); resume state comes from captures, which record
        # whatever a server sent: a vbucket id beyond what a bucket can have is no stream to resume
        self.states: dict[int, VbState] = {}
        for vb, s in (resume or {}).items():
            if 0 <= vb < NUM_VB_SLOTS:
                self.states.update(self._expand(vb, s))
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
        # per-stream arrays for the hot path, indexed by stream key
        self.max_sid = self.sids[-1]
        self._last = [0] * (NUM_VB_SLOTS * (self.max_sid + 1))
        self._sopq = [-1] * (NUM_VB_SLOTS * (self.max_sid + 1))   # opaque of the open stream, -1 none
        for k, st in self.states.items():
            self._last[k] = st.last_seqno
        self._oso: dict[int, list] = {}      # stream key -> [Y, X] inside an OSO snapshot (consumer_receive.py)
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
        for k, st in self.states.items():
            st.last_seqno = self._held_last(k)
            st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
        return {vb: _copy(st) for vb, st in self.vb_states().items()}

    def vb_states(self) -> dict[int, VbState]:
        """The live state per vbucket (with stream ids: a summary holding each stream's)."""
        if self.sids == (0,):
            return dict(self.states)
        by_vb: dict[int, dict] = {}
        for k, st in self.states.items():
            by_vb.setdefault(key_vb(k), {})[key_sid(k)] = st
        return {vb: _summary(ss) for vb, ss in by_vb.items()}

    def _expand(self, vb: int, state: VbState) -> dict[int, VbState]:
        """A vbucket's state as the states of its streams (by stream key)."""
        if self.sids == (0,):
            return {vb: _copy(state)}
        out = {}
        for sid in self.sids:
            st = state.streams.get(sid)
            if st is None:   # recorded without this stream: a new stream of it (same branch)
                st = VbState(failover_log=list(state.failover_log)) if state.streams else state
            out[stream_key(vb, sid)] = _copy(st)
        return out

    def _keys_of(self, vb: int) -> list[int]:
        return [stream_key(vb, sid) for sid in self.sids]

    # ---- commands of a cluster session (transport/dcp_cluster.py)
    def adopt(self, vb: int, state: VbState) -> None:
        """Take over a vbucket's state (it moved here from another connection)."""
        if not 0 <= vb < NUM_VB_SLOTS:
            return      # resume state recorded from a hostile server: no stream to resume
        for k, st in self._expand(vb, state).items():
            self.states[k] = st
            self._last[k] = st.last_seqno

    def add_vbuckets(self, states: dict[int, VbState]) -> None:
        """Stream these vbuckets too, from their states (a streaming connection, not finished)."""
        for vb, st in states.items():
            self.adopt(vb, st)
            if self.phase != "streaming":
                self.cfg = dataclasses.replace(self.cfg, vbuckets=[*(self.cfg.vbuckets or ()), vb])
                continue
            for k in self._keys_of(vb):
                self._reopens.pop(k, None)
                self._phase[k] = _WAIT
                self._queue.append(k)
        if self.phase == "streaming":
            self._pump()

    def take_states(self, vbuckets) -> dict[int, VbState]:
        """Give up these vbuckets (handed off, or their stream is to move): their states,
        current to the last seqno received. The connection forgets them."""
        out = {}
        for vb in vbuckets:
            mine = {}
            for k in self._keys_of(vb):
                st = self.states.pop(k, None)
                if st is None:
                    continue
                self._leave_oso(k)
                st.last_seqno = self._last[k]
                st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
                mine[key_sid(k)] = st
                self._sopq[k] = -1
                if self._phase.pop(k, None) in (_FLOG, _REQ):
                    self._in_flight -= 1     # its answer, when it comes, is ignored
                if k in self._queue:
                    self._queue.remove(k)
            if mine:
                out[vb] = mine[0] if self.sids == (0,) else _summary(mine)
        self._check_finished()
        return out

    def unfinished(self) -> list[int]:
        """The vbuckets this connection streams or will, whose streams have not all ended or failed."""
        if self.phase != "streaming":
            return list(self.cfg.vbuckets or ())
        return sorted({key_vb(k) for k, p in self._phase.items() if p != _DONE})

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
        for k, ph in self._phase.items():
            if ph == _OPEN:
                self._request(m.CloseStream(vbucket=key_vb(k), frame_infos=_sid_info(key_sid(k))),
                              lambda f: None)

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
            for k in self._keys_of(vb):
                st = self.states.get(k)
                if st is not None and st.ended_reason is not None:
                    continue
                if st is None:
                    self.states[k] = VbState()
                self._phase[k] = _WAIT
                self._queue.append(k)
        self._pump()
        self._check_finished()

    def _pump(self) -> None:
        while self._queue and self._in_flight < self.cfg.max_in_flight and not self.closing:
            k = self._queue.pop(0)
            self._in_flight += 1
            self._send_stream_req(k)

    def _fresh(self, k: int) -> bool:
        st = self.states[k]
        return not st.failover_log and st.last_seqno == 0

    def _stream_value(self, sid: int) -> bytes:
        """The STREAM_REQ value of stream id sid: its group's filter and the sid."""
        if not sid:
            return self.stream_value
        flt = self._sid_filters.get(sid) if self._sid_filters else None
        return dcp_collections.filter_value({**(flt or {}), "sid": sid})

    def _resolve_filters(self, manifest) -> dict:
        """handshake.py: the filter of --scope / --collection (raises UnknownNames); with
        stream ids, each group's too (self._sid_filters)."""
        cfg = self.cfg
        if cfg.stream_ids and cfg.stream_groups:
            self._sid_filters = {i + 1: dcp_collections.resolve(manifest, tuple(sc), tuple(co))
                                 for i, (sc, co) in enumerate(cfg.stream_groups)}
        return dcp_collections.resolve(manifest, tuple(cfg.scopes), tuple(cfg.collection_names))

    def sid_filters(self) -> tuple:
        """The filter of each stream id (1, 2, ...) for the FilterResolved event; () without."""
        return tuple(self._sid_filters.get(sid) for sid in self.sids) if self._sid_filters else ()

    @staticmethod
    def _name(k: int) -> str:
        sid = key_sid(k)
        return f"vbucket {key_vb(k)}" + (f" stream id {sid}" if sid else "")

    def _send_stream_req(self, k: int) -> None:
        st = self.states[k]
        vb, sid = key_vb(k), key_sid(k)
        cfg = self.cfg
        flags = 0
        if self._fresh(k):
            if cfg.start == "now":
                flags |= StreamRequestFlag.FROM_LATEST
                start = uuid = ss = se = 0
            elif cfg.start not in ("0", "") and int(cfg.start) > 0 and not st.failover_log:
                self._phase[k] = _FLOG   # a start seqno needs the branch it belongs to
                self._request(m.GetFailoverLog(vbucket=vb), lambda rsp, k=k: self._on_flog(k, rsp))
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
                self._events.append(StreamEnded(vb, StreamEndReason.OK, True, sid))
                self._finish_vb(k, StreamEndReason.OK)
                return
        self._phase[k] = _REQ
        self._end_seqno[k] = end
        req = m.StreamRequest(vbucket=vb, flags=int(flags), start_seqno=start, end_seqno=end,
                              vbucket_uuid=uuid, snap_start=ss, snap_end=se, value=self._stream_value(sid))
        self._request(req, lambda rsp, k=k, start=start: self._on_stream_rsp(k, start, rsp))

    def _on_flog(self, k: int, rsp) -> None:
        if k not in self._phase:
            return      # given up meanwhile
        st = self.states[k]
        if rsp.status == Status.NOT_MY_VBUCKET and self.cfg.handoff:
            self._in_flight -= 1
            self._not_mine(k, rsp)
            return
        if rsp.status != Status.SUCCESS or not rsp.failover_log:
            self._in_flight -= 1
            self._stream_failed(k, rsp.status)
            self._pump()
            return
        want = int(self.cfg.start)
        st.failover_log = list(rsp.failover_log)
        st.last_seqno = self._last[k] = want
        st.snap_start = st.snap_end = want
        st.snapshot_complete = True
        self._send_stream_req(k)

    def _not_mine(self, k: int, rsp) -> None:
        self._events.append(NotMyVbucket(key_vb(k), bytes(getattr(rsp, "value", b"") or b"")))
        self._phase[k] = _WAIT     # until the caller takes it (take_states)
        self._pump()

    def _on_stream_rsp(self, k: int, start: int, rsp) -> None:
        if k not in self._phase:
            return      # given up meanwhile
        st = self.states[k]
        vb, sid = key_vb(k), key_sid(k)
        status = rsp.status
        if status == Status.NOT_MY_VBUCKET and self.cfg.handoff:
            self._in_flight -= 1
            self._not_mine(k, rsp)
            return
        if status == Status.SUCCESS or status == Status.KEY_EEXISTS:
            if rsp.failover_log is not None:
                st.failover_log = list(rsp.failover_log)
            self._in_flight -= 1
            self._phase[k] = _OPEN
            self._sopq[k] = rsp.opaque
            self._oso.pop(k, None)
            self._last[k] = st.last_seqno = start
            self._events.append(StreamOpened(vb, start, tuple(st.failover_log), sid))
            self._pump()
            return
        if status == Status.ROLLBACK:
            r = rsp.rollback_seqno or 0
            n = self._rollbacks.get(k, 0) + 1
            self._rollbacks[k] = n
            if n > self.cfg.max_rollbacks:
                raise RemoteError(ErrorCode.STATUS, f"{self._name(k)}: more than {self.cfg.max_rollbacks} rollbacks",
                                  status)
            self._rollback(k, r)
            self._events.append(Rollback(vb, r, sid))
            self._send_stream_req(k)
            return
        if status in (Status.EACCESS, Status.AUTH_ERROR):
            raise AuthRefused(f"stream request for {self._name(k)} denied: {status_name(status)}", status)
        if status in (Status.NOT_SUPPORTED, Status.EINVAL, Status.DCP_STREAM_ID_INVALID):
            raise RemoteError(ErrorCode.STATUS, f"stream request for {self._name(k)} refused: "
                              f"{status_name(status)}", status)
        self._in_flight -= 1
        self._stream_failed(k, status)
        self._pump()

    def _rollback(self, k: int, r: int) -> None:
        st = self.states[k]
        st.failover_log = [e for e in st.failover_log if e[1] <= r]
        if r < self._last[k] or not st.failover_log:
            self._last[k] = r
        st.last_seqno = self._last[k] = min(self._last[k], r)
        st.snap_start = st.snap_end = st.last_seqno
        st.snapshot_complete = True

    def _stream_failed(self, k: int, status: int) -> None:
        self._phase[k] = _DONE
        self._events.append(StreamFailed(key_vb(k), status, key_sid(k)))
        self._check_finished()

    def _finish_vb(self, k: int, reason: int) -> None:
        self._phase[k] = _DONE
        self._sopq[k] = -1
        st = self.states[k]
        st.ended_reason = reason
        st.last_seqno = self._last[k]
        self._check_finished()

    def _stream_end(self, k: int, reason: int) -> None:
        st = self.states[k]
        vb, sid = key_vb(k), key_sid(k)
        self._leave_oso(k)
        st.last_seqno = self._last[k]
        st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
        self._sopq[k] = -1
        if self.cfg.handoff and reason == StreamEndReason.STATE_CHANGED and not self.closing:
            self._events.append(StreamEnded(vb, reason, False, sid))
            self._events.append(Handoff(vb, reason))
            self._phase[k] = _WAIT     # until the caller takes it (take_states)
            return
        n = self._reopens.get(k, 0)
        if reason in self.cfg.reopen_reasons and n < self.cfg.max_reopens and not self.closing:
            self._reopens[k] = n + 1
            self._events.append(StreamEnded(vb, reason, False, sid))
            self._phase[k] = _WAIT
            self._queue.append(k)
            self._pump()
            return
        self._events.append(StreamEnded(vb, reason, True, sid))
        self._finish_vb(k, reason)

    def _check_finished(self) -> None:
        if self.finished or self.phase != "streaming":
            return
        if all(p == _DONE for p in self._phase.values()):
            self.finished = True
            failed = sum(1 for k in self._phase if self.states[k].ended_reason is None)
            self._events.append(Finished(len(self._phase) - failed, failed))

    # ---- introspection
    def open_streams(self) -> int:
        return sum(1 for p in self._phase.values() if p == _OPEN)

    def last_seqno(self, vb: int, sid: int = 0) -> int:
        return self._held_last(stream_key(vb, sid))

    def describe_end(self, reason: int) -> str:
        return stream_end_reason_name(reason)


def _copy(st: VbState) -> VbState:
    return dataclasses.replace(st, failover_log=list(st.failover_log),
                               streams={sid: _copy(x) for sid, x in st.streams.items()})


def _summary(streams: dict[int, VbState]) -> VbState:
    """A vbucket's state made of its streams' (stream ids): the lowest position, ended when
    every stream ended; `streams` keeps each one."""
    ss = list(streams.values())
    low = min(ss, key=lambda x: x.last_seqno)
    ended = None if any(x.ended_reason is None for x in ss) else ss[0].ended_reason
    return VbState(failover_log=list(low.failover_log), last_seqno=low.last_seqno, snap_start=low.snap_start,
                   snap_end=low.snap_end, snapshot_complete=low.snapshot_complete, ended_reason=ended,
                   streams=dict(streams))


def _sid_info(sid: int) -> tuple:
    """The frame info of a request for stream id sid (CLOSE_STREAM); () for no stream id."""
    return ((FrameInfoId.DCP_STREAM_ID, sid.to_bytes(2, "big")),) if sid else ()
