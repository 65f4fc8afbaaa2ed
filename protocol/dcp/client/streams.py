"""The consumer's streams, sans-IO: one state per stream key (consumer_api.stream_key), the
stream requests with a bounded number in flight, GET_FAILOVER_LOG for a start seqno, the
rollback loop, stream ends and reopens, handoffs, OSO snapshots and the end condition of
`--to`. A phase of consumer.Consumer, composed in: it owns the per-stream tables (public, for
the receive path: `last`, `sopq`, `oso`, `states`) and sends through the shared Link.

Each stream is in one StreamPhase (phases.py; the `phase` table, by stream key): waiting for
its turn (WAIT), asking the failover log of a start seqno (FLOG), asking the stream (REQ, again
after each rollback), open (OPEN: its opaque in `sopq`), done (DONE: ended or failed). An end
with a reopen reason, a handoff or NOT_MY_VBUCKET puts it back to WAIT. Every move goes through
phases.STREAM_MOVES; an answer to a request the stream no longer waits for is ignored.

The positions (`last`, `exact`, `sopq`, `oso`) are this object's alone: the receive path reads
them and reports what arrived through `take_data` (the per-frame fast path), `apply_run` (a
long run of data frames, column-wise) and `advance` (one item of the slow path).

Streams are keyed by stream_key(vbucket, stream id): the vbucket itself without stream ids;
with them (enable_stream_id) one stream per vbucket and group, sids 1..n, each with its own
state, filter and opaque. What goes in and out (resume, adopt, take_states, resume_state,
vb_states) stays per vbucket: a VbState whose `streams` holds the per-sid states."""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any, Callable

from dcptool.protocol.dcp.client.consumer_api import (
    ConsumerConfig,
    Finished,
    Handoff,
    NotMyVbucket,
    Rollback,
    StreamEnded,
    StreamFailed,
    StreamOpened,
    VbState,
)
from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.client.phases import STREAM_MOVES, StreamPhase, move
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    NUM_VB_SLOTS,
    SEQNO_INFINITY,
    FrameInfoId,
    Opcode,
    Status,
    StreamEndReason,
    StreamRequestFlag,
    key_sid,
    key_vb,
    status_name,
    stream_key,
)
from dcptool.protocol.errors import AuthRefused, ErrorCode, RemoteError

WAIT, FLOG, REQ, OPEN, DONE = (StreamPhase.WAIT, StreamPhase.FLOG, StreamPhase.REQ, StreamPhase.OPEN,
                                StreamPhase.DONE)
OSO_START, OSO_END = 0x01, 0x02
OSO_HOLD = (1 << 63) - 1   # `last` of a stream inside an OSO snapshot: no item passes the fast paths
DATA = struct.Struct(">BB4xH4xI8xQ")     # magic opcode . vbucket . opaque . by_seqno
DATA_SID = struct.Struct(">6xH4xI8xxHQ")  # alt framing: vbucket . opaque . 0x22 sid . by_seqno
DATA_OPS = frozenset(int(o) for o in (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION,
                                      Opcode.DCP_SYSTEM_EVENT, Opcode.DCP_SEQNO_ADVANCED))


class Streams:
    def __init__(self, link: Link, resume: dict[int, VbState] | None, stream_value: Callable[[int], bytes]):
        self.link = link
        self.stream_value = stream_value      # sid -> the STREAM_REQ value (handshake.py)
        self.sids = link.sids
        self.max_sid = self.sids[-1]
        # per stream key; resume state comes from captures, which record whatever a server
        # sent: a vbucket id beyond what a bucket can have is no stream to resume
        self.states: dict[int, VbState] = {}
        for vb, s in (resume or {}).items():
            if 0 <= vb < NUM_VB_SLOTS:
                self.states.update(self._expand(vb, s))
        # per-stream arrays for the hot path, indexed by stream key
        self.last = [0] * (NUM_VB_SLOTS * (self.max_sid + 1))
        self.sopq = [-1] * (NUM_VB_SLOTS * (self.max_sid + 1))   # opaque of the open stream, -1 none
        # VbState.exact_from per stream key: the receive path sets it to -1 at a gap in seqnos
        self.exact = [-1] * (NUM_VB_SLOTS * (self.max_sid + 1))
        for k, st in self.states.items():
            self.last[k] = st.last_seqno
            self.exact[k] = st.exact_from
        self.oso: dict[int, list[int]] = {}      # stream key -> [Y, X] inside an OSO snapshot
        self.phase: dict[int, StreamPhase] = {}
        self.active = False                 # streaming: the handshake is complete
        self.finished = False
        self.closing = False
        self._queue: list[int] = []
        self._in_flight = 0
        self._reopens: dict[int, int] = {}
        self._rollbacks: dict[int, int] = {}
        self._end_seqno: dict[int, int] = {}
        self.requested: set[int] = set()    # stream keys a STREAM_REQ was sent for (lag polls count them)
        self.from_latest: set[int] = set()  # ... whose last one asked FROM_LATEST: no position before a change

    @property
    def cfg(self) -> ConsumerConfig:
        return self.link.cfg

    def _move(self, k: int, to: StreamPhase) -> None:
        self.phase[k] = move(STREAM_MOVES, self.phase[k], to, self.name(k))

    def _enter(self, k: int) -> None:
        """Stream k waits for its turn: a new stream, or one given to this connection again."""
        if k in self.phase:
            self._move(k, WAIT)
        else:
            self.phase[k] = WAIT

    # ---- in and out, per vbucket
    def resume_state(self) -> dict[int, VbState]:
        for k, st in self.states.items():
            st.last_seqno = self.held_last(k)
            st.exact_from = self.exact[k]
            st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
        return {vb: copy_state(st) for vb, st in self.vb_states().items()}

    @property
    def opening(self) -> bool:
        """Some stream waits for its turn or for the answer to its request."""
        return bool(self._queue) or self._in_flight > 0

    def positions(self) -> dict[int, int]:
        """vbucket -> the last seqno received (or the start seqno of its last STREAM_REQ before
        any), current to the frame being processed, of each vbucket a STREAM_REQ was sent for
        (with stream ids: the lowest of its streams), but for a stream asked from the latest
        (`--from now`) before its first change. What a lag poll is measured against (CLI.md
        "Lag"); vb_states() holds the seqnos only as of the last snapshot boundary."""
        out: dict[int, int] = {}
        for k in self.requested:
            if k in self.from_latest and self.last[k] == 0:
                continue        # `--from now`: where it starts is not known before its first change
            vb, pos = key_vb(k), self.held_last(k)
            out[vb] = pos if vb not in out else min(out[vb], pos)
        return out

    def vb_states(self) -> dict[int, VbState]:
        if self.sids == (0,):
            return dict(self.states)
        by_vb: dict[int, dict[int, VbState]] = {}
        for k, st in self.states.items():
            by_vb.setdefault(key_vb(k), {})[key_sid(k)] = st
        return {vb: summary(ss) for vb, ss in by_vb.items()}

    def _expand(self, vb: int, state: VbState) -> dict[int, VbState]:
        """A vbucket's state as the states of its streams (by stream key)."""
        if self.sids == (0,):
            return {vb: copy_state(state)}
        out = {}
        for sid in self.sids:
            st = state.streams.get(sid)
            if st is None:   # recorded without this stream: a new stream of it (same branch)
                st = VbState(failover_log=list(state.failover_log)) if state.streams else state
            out[stream_key(vb, sid)] = copy_state(st)
        return out

    def keys_of(self, vb: int) -> list[int]:
        return [stream_key(vb, sid) for sid in self.sids]

    def adopt(self, vb: int, state: VbState) -> None:
        if not 0 <= vb < NUM_VB_SLOTS:
            return      # resume state recorded from a hostile server: no stream to resume
        for k, st in self._expand(vb, state).items():
            self.states[k] = st
            self.last[k] = st.last_seqno
            self.exact[k] = st.exact_from

    def add(self, vb: int) -> None:
        """Stream this (adopted) vbucket too, on a streaming connection. A connection whose
        last stream just ended is not finished any more: in the same receive, a vbucket that
        ended "state changed" can be handed straight back to it by the map."""
        self.finished = False
        for k in self.keys_of(vb):
            self._reopens.pop(k, None)
            self._enter(k)
            self._queue.append(k)

    def take(self, vb: int) -> VbState | None:
        """Give up a vbucket: its state, current to the last seqno received, or None."""
        mine = {}
        for k in self.keys_of(vb):
            st = self.states.pop(k, None)
            if st is None:
                continue
            self.leave_oso(k)
            st.last_seqno = self.last[k]
            st.exact_from = self.exact[k]
            st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
            mine[key_sid(k)] = st
            self.sopq[k] = -1
            self.requested.discard(k)
            if self.phase.pop(k, None) in (FLOG, REQ):
                self._in_flight -= 1     # its answer, when it comes, is ignored
            if k in self._queue:
                self._queue.remove(k)
        if not mine:
            return None
        return mine[0] if self.sids == (0,) else summary(mine)

    def unfinished(self) -> list[int]:
        return sorted({key_vb(k) for k, p in self.phase.items() if p != DONE})

    def close_all(self) -> None:
        """Ask the producer to close every open stream."""
        self.closing = True
        for k, ph in self.phase.items():
            if ph == OPEN:
                self.link.request(m.CloseStream(vbucket=key_vb(k), frame_infos=sid_info(key_sid(k))),
                                  lambda f: None)

    def last_seqno(self, vb: int, sid: int = 0) -> int:
        """The resume point of the stream of (vb, sid)."""
        return self.held_last(stream_key(vb, sid))

    def opaque_of(self, vb: int, sid: int = 0) -> int:
        """The opaque of the open stream of (vb, sid), -1 when none is open."""
        return self.sopq[stream_key(vb, sid)]

    # ---- requests
    def start(self) -> None:
        """The handshake is complete: request every configured vbucket's streams."""
        self.active = True
        for vb in self.cfg.vbuckets or ():
            for k in self.keys_of(vb):
                st = self.states.get(k)
                if st is not None and st.ended_reason is not None:
                    continue
                if st is None:
                    self.states[k] = VbState()
                self._enter(k)
                self._queue.append(k)
        self.pump()
        self.check_finished()

    def pump(self) -> None:
        while self._queue and self._in_flight < self.cfg.max_in_flight and not self.closing:
            k = self._queue.pop(0)
            self._in_flight += 1
            self._send_stream_req(k)

    def _fresh(self, k: int) -> bool:
        st = self.states[k]
        return not st.failover_log and st.last_seqno == 0

    def name(self, k: int) -> str:
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
                self._move(k, FLOG)   # a start seqno needs the branch it belongs to
                self.link.request(m.GetFailoverLog(vbucket=vb), functools.partial(self._on_flog, k))
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
                self.link.emit(StreamEnded(vb, StreamEndReason.OK, True, sid))
                self._finish(k, StreamEndReason.OK)
                return
        self._move(k, REQ)
        self._end_seqno[k] = end
        req = m.StreamRequest(vbucket=vb, flags=int(flags), start_seqno=start, end_seqno=end,
                              vbucket_uuid=uuid, snap_start=ss, snap_end=se, value=self.stream_value(sid))
        self.requested.add(k)
        if flags & StreamRequestFlag.FROM_LATEST:
            self.from_latest.add(k)
        else:
            self.from_latest.discard(k)
        self.last[k] = start       # where the stream stands until its first change (as the `lag` table counts)
        self.link.request(req, functools.partial(self._on_stream_rsp, k, start))

    def _on_flog(self, k: int, rsp: Any) -> None:
        if self.phase.get(k) is not FLOG:
            return      # given up meanwhile (taken, perhaps given back since)
        st = self.states[k]
        if rsp.status == Status.NOT_MY_VBUCKET and self.cfg.handoff:
            self._in_flight -= 1
            self._not_mine(k, rsp)
            return
        if rsp.status != Status.SUCCESS or not rsp.failover_log:
            self._in_flight -= 1
            self._failed(k, rsp.status)
            self.pump()
            return
        want = int(self.cfg.start)
        st.failover_log = list(rsp.failover_log)
        st.last_seqno = self.last[k] = want
        st.snap_start = st.snap_end = want
        st.snapshot_complete = True
        self._send_stream_req(k)

    def _not_mine(self, k: int, rsp: Any) -> None:
        self.link.emit(NotMyVbucket(key_vb(k), bytes(getattr(rsp, "value", b"") or b"")))
        self._move(k, WAIT)     # until the caller takes it (take_states)
        self.pump()

    def _on_stream_rsp(self, k: int, start: int, rsp: Any) -> None:
        if self.phase.get(k) is not REQ:
            return      # given up meanwhile (taken, perhaps given back since)
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
            self._move(k, OPEN)
            self.sopq[k] = rsp.opaque
            self.oso.pop(k, None)
            self.last[k] = st.last_seqno = start
            self.link.emit(StreamOpened(vb, start, tuple(st.failover_log), sid))
            self.pump()
            return
        if status == Status.ROLLBACK:
            r = rsp.rollback_seqno or 0
            n = self._rollbacks.get(k, 0) + 1
            self._rollbacks[k] = n
            if n > self.cfg.max_rollbacks:
                raise RemoteError(ErrorCode.STATUS, f"{self.name(k)}: more than {self.cfg.max_rollbacks} rollbacks",
                                  status)
            self._rollback(k, r)
            self.link.emit(Rollback(vb, r, sid))
            self._send_stream_req(k)
            return
        if status in (Status.EACCESS, Status.AUTH_ERROR):
            raise AuthRefused(f"stream request for {self.name(k)} denied: {status_name(status)}", status)
        if status in (Status.NOT_SUPPORTED, Status.EINVAL, Status.DCP_STREAM_ID_INVALID):
            raise RemoteError(ErrorCode.STATUS, f"stream request for {self.name(k)} refused: "
                              f"{status_name(status)}", status)
        self._in_flight -= 1
        self._failed(k, status)
        self.pump()

    def _rollback(self, k: int, r: int) -> None:
        st = self.states[k]
        st.failover_log = [e for e in st.failover_log if e[1] <= r]
        if r < self.last[k] and not 0 <= self.exact[k] <= r:
            # a deduplicated snapshot has no state at r (a seqno at or below it is missing):
            # back to the newest whole-snapshot end at or below it, as kv_engine's replicas
            # roll back to a header (PROTOCOLS.md "Consumer rules")
            below = [p for p in st.points if p <= r]
            self.last[k] = below[-1] if below else r
        elif r < self.last[k] or not st.failover_log:
            self.last[k] = r
        st.last_seqno = self.last[k] = min(self.last[k], r)
        st.points = [p for p in st.points if p <= st.last_seqno]
        self.exact[k] = st.exact_from = st.last_seqno
        st.snap_start = st.snap_end = st.last_seqno
        st.snapshot_complete = True

    def _failed(self, k: int, status: int) -> None:
        self._move(k, DONE)
        self.link.emit(StreamFailed(key_vb(k), status, key_sid(k)))
        self.check_finished()

    def _finish(self, k: int, reason: int) -> None:
        self._move(k, DONE)
        self.sopq[k] = -1
        st = self.states[k]
        st.ended_reason = reason
        st.last_seqno = self.last[k]
        self.check_finished()

    # ---- what the receive path reports
    def take_data(self, buf: Any, offsets: list[int], lengths: list[int], i: int) -> tuple[int, int, int]:
        """The per-frame fast path: apply the data frames of open streams from index `i` on,
        in wire order, up to the first frame that is not one or breaks a rule (that frame
        goes the slow path). Returns (its index, or len(offsets); the bytes applied; the
        frames applied)."""
        unpack = DATA.unpack_from
        last, exact, sopq, oso = self.last, self.exact, self.sopq, self.oso
        max_sid = self.max_sid
        unacked = data = 0
        n = len(offsets)
        while i < n:
            off = offsets[i]
            ln = lengths[i]
            op = buf[off + 1]
            if op in DATA_OPS and ln >= 32 and buf[off] == 0x80:
                _, _, vb, opaque, seq = unpack(buf, off)
                if vb < NUM_VB_SLOTS and opaque == sopq[vb] and seq > last[vb]:
                    if seq != last[vb] + 1:
                        exact[vb] = -1
                    last[vb] = seq
                elif oso and vb in oso and opaque == sopq[vb]:    # an OSO snapshot's item (key order)
                    self.oso_item(vb, seq)
                else:
                    break
            elif max_sid and op in DATA_OPS and ln >= 35 and buf[off] == 0x08 and buf[off + 2] == 3 \
                    and buf[off + 24] == 0x22:
                vb, opaque, sid, seq = DATA_SID.unpack_from(buf, off)
                k = stream_key(vb, sid)
                if vb < NUM_VB_SLOTS and sid <= max_sid and opaque == sopq[k] and seq > last[k]:
                    if seq != last[k] + 1:
                        exact[k] = -1
                    last[k] = seq
                else:
                    break
            else:
                break
            unacked += ln
            data += 1
            i += 1
        return i, unacked, data

    def apply_run(self, keys: Any, seqnos: Any) -> bool:
        """A run of data frames of open streams, column-wise (numpy arrays: stream keys and
        by_seqnos in wire order): applied when every stream's seqnos rise, else False and
        nothing changed (the run takes the per-frame path, which reports what is wrong)."""
        import numpy as np  # lazily: the consumer is imported by commands that never stream
        if (seqnos >= 1 << 63).any():
            return False
        q = seqnos.astype(np.int64)
        order = np.argsort(keys, kind="stable")
        v_sorted, q_sorted = keys[order], q[order]
        first = np.ones(len(v_sorted), dtype=bool)
        first[1:] = v_sorted[1:] != v_sorted[:-1]
        last = np.asarray(self.last, dtype=np.int64)
        rising = np.where(first, q_sorted > last[v_sorted], np.r_[True, q_sorted[1:] > q_sorted[:-1]])
        if not rising.all():
            return False
        ends = np.r_[np.nonzero(first)[0][1:] - 1, len(v_sorted) - 1]
        step = np.where(first, q_sorted - last[v_sorted], np.r_[1, np.diff(q_sorted)])
        if (step != 1).any():   # a gap in seqnos (deduplicated, filtered): no exact state in it
            exact = self.exact
            for k in np.unique(v_sorted[step != 1]).tolist():
                exact[k] = -1
        positions = self.last
        for k, seq in zip(v_sorted[ends].tolist(), q_sorted[ends].tolist()):
            positions[k] = seq
        return True

    def advance(self, k: int, seq: int) -> None:
        """An item of stream k decoded by the slow path (a data frame that took it, a prepare,
        commit or abort): inside an OSO snapshot held until its end, else its seqno must rise."""
        if k in self.oso:      # inside an OSO snapshot: key order, held until its end
            self.oso_item(k, seq)
            return
        if seq <= self.last[k]:
            raise RemoteError(ErrorCode.UNEXPECTED_MESSAGE, f"{self.name(k)}: seqno {seq} after {self.last[k]}")
        if seq != self.last[k] + 1:
            self.exact[k] = -1
        self.last[k] = seq

    def snapshot(self, k: int, msg: Any) -> None:
        """A snapshot marker of stream k."""
        st = self.states[k]
        self.leave_oso(k)      # a marker inside an OSO snapshot (verify flags it) ends it unfinished
        st.last_seqno = last = self.last[k]
        if last >= st.snap_end:         # the snapshot before this one is whole
            if not st.points or st.points[-1] < last:
                st.points.append(last)
                del st.points[:-32]
            if self.exact[k] < 0:
                self.exact[k] = last
        st.snap_start, st.snap_end = msg.snap_start, msg.snap_end
        st.snapshot_complete = st.last_seqno >= st.snap_end

    def ended(self, k: int, reason: int) -> None:
        """A stream end of stream k: reopened, handed off, or done."""
        st = self.states[k]
        vb, sid = key_vb(k), key_sid(k)
        self.leave_oso(k)
        st.last_seqno = self.last[k]
        st.snapshot_complete = st.snapshot_complete or st.last_seqno >= st.snap_end
        self.sopq[k] = -1
        if self.cfg.handoff and reason == StreamEndReason.STATE_CHANGED and not self.closing:
            self.link.emit(StreamEnded(vb, reason, False, sid))
            self.link.emit(Handoff(vb, reason))
            self._move(k, WAIT)     # until the caller takes it (take_states)
            return
        n = self._reopens.get(k, 0)
        if reason in self.cfg.reopen_reasons and n < self.cfg.max_reopens and not self.closing:
            self._reopens[k] = n + 1
            self.link.emit(StreamEnded(vb, reason, False, sid))
            self._move(k, WAIT)
            self._queue.append(k)
            self.pump()
            return
        self.link.emit(StreamEnded(vb, reason, True, sid))
        self._finish(k, reason)

    def check_finished(self) -> None:
        if self.finished or not self.active:
            return
        if all(p == DONE for p in self.phase.values()):
            self.finished = True
            failed = sum(1 for k in self.phase if self.states[k].ended_reason is None)
            self.link.emit(Finished(len(self.phase) - failed, failed))

    # ---- OSO snapshots (DCP_DIGEST §5.9, REPLAY.md): items in key order between a start and
    # an end. The resume point stays at the seqno before the start (Y) until the end, then
    # moves to the highest seqno received in it (X); meanwhile `last` holds OSO_HOLD so that
    # every item of the snapshot takes the per-frame path of the receive path.
    def oso_marker(self, k: int, flags: int) -> None:
        if flags & OSO_START and k not in self.oso:
            self.oso[k] = [self.last[k], self.last[k]]
            self.last[k] = OSO_HOLD
        elif flags & OSO_END and k in self.oso:
            x = self.oso.pop(k)[1]
            st = self.states[k]
            st.last_seqno = st.snap_start = st.snap_end = self.last[k] = x
            st.snapshot_complete = True
            self.exact[k] = x          # whole, in key order: nothing below x to restart at

    def oso_item(self, k: int, seq: int) -> None:
        held = self.oso[k]
        if seq <= held[0]:
            raise RemoteError(ErrorCode.UNEXPECTED_MESSAGE,
                              f"{self.name(k)}: seqno {seq} in an OSO snapshot that started after {held[0]}")
        if seq > held[1]:
            held[1] = seq

    def leave_oso(self, k: int) -> None:
        """The stream of `k` ends or restarts: an unfinished OSO snapshot counts for nothing."""
        held = self.oso.pop(k, None)
        if held is not None:
            self.last[k] = held[0]
            self.exact[k] = -1

    def held_last(self, k: int) -> int:
        """The resume point of `k`: inside an OSO snapshot, the seqno before its start."""
        held = self.oso.get(k)
        return self.last[k] if held is None else held[0]


def copy_state(st: VbState) -> VbState:
    return dataclasses.replace(st, failover_log=list(st.failover_log), points=list(st.points),
                               streams={sid: copy_state(x) for sid, x in st.streams.items()})


def summary(streams: dict[int, VbState]) -> VbState:
    """A vbucket's state made of its streams' (stream ids): the lowest position, ended when
    every stream ended; `streams` keeps each one."""
    ss = list(streams.values())
    low = min(ss, key=lambda x: x.last_seqno)
    ended = None if any(x.ended_reason is None for x in ss) else ss[0].ended_reason
    return VbState(failover_log=list(low.failover_log), last_seqno=low.last_seqno, snap_start=low.snap_start,
                   snap_end=low.snap_end, snapshot_complete=low.snapshot_complete, ended_reason=ended,
                   points=list(low.points), exact_from=low.exact_from,
                   streams=dict(streams))


def sid_info(sid: int) -> tuple[tuple[int, bytes], ...]:
    """The frame info of a request for stream id sid (CLOSE_STREAM); () for no stream id."""
    return ((FrameInfoId.DCP_STREAM_ID, sid.to_bytes(2, "big")),) if sid else ()
