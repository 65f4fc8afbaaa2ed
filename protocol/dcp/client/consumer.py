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

The consumer is a composition of phases that each own their state and meet only through
public names: the shared Link (link.py: configuration, frames out, events, pending requests
and the clock), the Handshake (handshake.py), the Streams (streams.py: per-stream phases,
requests, rollbacks, OSO) and the Receiver (consumer_receive.py: the hot path for data
frames, and server requests such as cluster-map change notifications). This class holds
them together and is the one API callers use.

Streams are keyed by consumer_api.stream_key(vbucket, stream id): the vbucket itself without
stream ids; with them (enable_stream_id) one stream per vbucket and group, sids 1..n, each with
its own state, filter and opaque. What goes in and out (resume, adopt, take_states,
resume_state, vb_states) stays per vbucket: a VbState whose `streams` holds the per-sid states.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from dcptool.protocol.dcp.client.consumer_api import (
    DEFAULT_REOPEN,
    NUM_VB_SLOTS,
    ConfigReceived,
    ConsumerConfig,
    ControlRefused,
    Finished,
    Handoff,
    HandshakeComplete,
    NotMyVbucket,
    Rollback,
    ServerVbuckets,
    StreamEnded,
    StreamFailed,
    StreamOpened,
    VbSeqnos,
    VbState,
)
from dcptool.protocol.dcp.client.consumer_receive import (
    DATA_OPS,
    STREAM_OPS,
    ConfigPushed,
    PushIgnored,
    Receiver,
)
from dcptool.protocol.dcp.client.handshake import Handshake
from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.client.streams import Streams
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    Feature,
    stream_end_reason_name,
    stream_key,
)
from dcptool.protocol.dcp.wire.frames import split_until_error
from dcptool.protocol.errors import ErrorCode, RemoteError

# the consumer's API is importable from here (consumer_api.py holds the definitions)
__all__ = ["Consumer", "ConsumerConfig", "VbState", "DEFAULT_REOPEN", "NUM_VB_SLOTS", "ConfigReceived",
           "ControlRefused", "Finished", "Handoff", "HandshakeComplete", "NotMyVbucket", "Rollback",
           "ServerVbuckets", "StreamEnded", "StreamFailed", "StreamOpened", "VbSeqnos", "ConfigPushed", "PushIgnored",
           "DATA_OPS", "STREAM_OPS"]


ACTIVE_STATE = (1).to_bytes(4, "big")    # GET_ALL_VB_SEQNOS extras: the active vbuckets only


class Consumer:
    # HELLO asks for these with Duplex: the server pushes each new cluster map (0x0d, whole)
    NOTIFY_FEATURES: tuple = (Feature.CLUSTERMAP_CHANGE_NOTIFICATION,)

    def __init__(self, config: ConsumerConfig, resume: dict[int, VbState] | None = None, now: float = 0.0):
        self.link = Link(config, now)
        self.handshake = Handshake(self.link, on_ready=self._on_ready)
        self.streams = Streams(self.link, resume, self.handshake.stream_value_of)
        self.receiver = Receiver(self.link, self.streams, lambda: self.collections, now)
        self.should_pause: Callable[[], bool] | None = None
        self.acked_total = 0
        self._tail = b""
        self.seqnos_pending = 0     # lag polls not answered yet: the connection is not finished
        self._polls: set[int] = set()   # their opaques

    def _on_ready(self) -> None:
        self.streams.start()

    # ---- what the phases own, under the names callers use
    @property
    def cfg(self) -> ConsumerConfig:
        return self.link.cfg

    @property
    def sids(self) -> tuple:
        return self.link.sids

    @property
    def max_sid(self) -> int:
        return self.streams.max_sid

    @property
    def states(self) -> dict[int, VbState]:
        return self.streams.states

    @property
    def vb_opaque(self) -> dict[int, int]:
        return self.link.vb_opaque

    @property
    def phase(self) -> str:
        return self.handshake.phase

    @property
    def features(self) -> tuple:
        return self.handshake.features

    @property
    def controls(self) -> dict[str, str]:
        return self.handshake.controls

    @property
    def refused(self) -> dict[str, int]:
        return self.handshake.refused

    @property
    def noop_active(self) -> bool:
        return self.handshake.noop_active

    @property
    def buffer_active(self) -> bool:
        return self.handshake.buffer_active

    @property
    def finished(self) -> bool:
        return self.streams.finished and not self.seqnos_pending

    @property
    def closing(self) -> bool:
        return self.streams.closing

    @property
    def last_rx(self) -> float:
        return self.receiver.last_rx

    @property
    def frames_in(self) -> int:
        return self.receiver.frames_in

    @property
    def data_frames(self) -> int:
        return self.receiver.data_frames

    @property
    def noops_answered(self) -> int:
        return self.receiver.noops_answered

    @property
    def stream_value(self) -> bytes:
        return self.handshake.stream_value

    @property
    def collections(self) -> bool:
        return Feature.COLLECTIONS in self.handshake.features

    def sid_filters(self) -> tuple:
        """The filter of each stream id (1, 2, ...) for the FilterResolved event; () without."""
        return self.handshake.filters_by_sid()

    def stream_opaque(self, vb: int, sid: int = 0) -> int:
        """The opaque of the open stream of (vb, sid), -1 when none is open."""
        return self.streams.sopq[stream_key(vb, sid)]

    # ---- public
    def start(self, now: float) -> None:
        """Queue the first request (HELLO)."""
        self.receiver.last_rx = self.link.now = now
        feats = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.SNAPPY, Feature.DUPLEX,
                 Feature.TCP_NODELAY, *self.NOTIFY_FEATURES]
        if self.cfg.xattrs:
            feats.append(Feature.XATTR)
        if self.cfg.collections:
            feats.append(Feature.COLLECTIONS)
        self.handshake.start(feats)

    def outgoing(self) -> list[bytes]:
        return self.link.take_out()

    def events(self) -> list:
        return self.link.take_events()

    def receive(self, buf, offsets, lengths, now: float) -> list:
        """Process the whole frames at offsets/lengths in buf (consumer_receive.py). Returns the events."""
        if len(offsets):
            self.receiver.receive(buf, offsets, lengths, now)
            self.flush_acks()
        return self.events()

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
        return self.streams.resume_state()

    def vb_states(self) -> dict[int, VbState]:
        """The live state per vbucket (with stream ids: a summary holding each stream's)."""
        return self.streams.vb_states()

    # ---- commands of a cluster session (transport/dcp_cluster.py)
    def request_config(self) -> None:
        """Ask GET_CLUSTER_CONFIG (a poll); the answer comes as ConfigReceived(bootstrap=False)."""
        self.handshake.request_config()

    def request_seqnos(self) -> None:
        """A lag poll: GET_ALL_VB_SEQNOS of the active vbuckets (extras: state 1); the answer
        comes as VbSeqnos, and the connection waits for it before it counts as finished (so a
        poll asked as the last stream ends is still answered)."""
        self.seqnos_pending += 1
        self._polls.add(self.link.request(m.GetAllVbSeqnos(extras=ACTIVE_STATE), self._on_seqnos))

    def _on_seqnos(self, rsp) -> None:
        self._polls.discard(rsp.opaque)
        self.seqnos_pending = max(0, self.seqnos_pending - 1)
        status = getattr(rsp, "status", 0)
        self.link.emit(VbSeqnos(tuple(getattr(rsp, "seqnos", ()) or ()) if status == 0 else (), status))

    def route(self, vbuckets: list[int] | None, *, states: dict | None = None, check: bool = False,
              handoff: bool = False) -> None:
        """After ConfigReceived(bootstrap=True): stream these vbuckets (None: every vbucket the
        server lists, as without a map) from `states` where given, and go on with DCP_OPEN."""
        self.link.cfg = dataclasses.replace(self.cfg, vbuckets=None if vbuckets is None else list(vbuckets),
                                            check_vbuckets=check, handoff=handoff, fetch_config=False)
        for vb, st in (states or {}).items():
            self.adopt(vb, st)
        self.handshake.after_select()

    def adopt(self, vb: int, state: VbState) -> None:
        """Take over a vbucket's state (it moved here from another connection)."""
        self.streams.adopt(vb, state)

    def add_vbuckets(self, states: dict[int, VbState]) -> None:
        """Stream these vbuckets too, from their states (a streaming connection, not finished)."""
        streaming = self.phase == "streaming"
        for vb, st in states.items():
            self.adopt(vb, st)
            if streaming:
                self.streams.add(vb)
            else:
                self.link.cfg = dataclasses.replace(self.cfg, vbuckets=[*(self.cfg.vbuckets or ()), vb])
        if streaming:
            self.streams.pump()

    def take_states(self, vbuckets) -> dict[int, VbState]:
        """Give up these vbuckets (handed off, or their stream is to move): their states,
        current to the last seqno received. The connection forgets them."""
        out = {}
        for vb in vbuckets:
            st = self.streams.take(vb)
            if st is not None:
                out[vb] = st
        self.streams.check_finished()
        return out

    def unfinished(self) -> list[int]:
        """The vbuckets this connection streams or will, whose streams have not all ended or failed."""
        if self.phase != "streaming":
            return list(self.cfg.vbuckets or ())
        return self.streams.unfinished()

    def check(self, now: float) -> None:
        """Raise RemoteError(TIMEOUT) when a request has waited longer than the timeout for
        its answer, RemoteError(DEAD_CONNECTION) when a streaming connection is silent for
        longer than its idle limit (idle_limit())."""
        self.link.now = now
        timeout = self.cfg.timeout
        if timeout and self._polls and self.streams.finished:
            self._give_up_polls(now, timeout)
        oldest = self.link.oldest_pending() if timeout else None
        if oldest is not None and now - oldest[0] > timeout:
            raise RemoteError(ErrorCode.TIMEOUT, f"no answer to {oldest[1]} from the server within "
                              f"{timeout:g} s (--timeout)")
        limit = None if self.streams.finished else self.idle_limit()   # ended: only a lag poll can be waiting
        if limit is not None and now - self.last_rx > limit:
            why = (f"noop interval {self.cfg.noop_interval:g} s" if self.noop_active else
                   f"the server refused noops: idle limit max(2 x noop interval, --timeout {timeout:g} s)")
            raise RemoteError(ErrorCode.DEAD_CONNECTION,
                              f"no frame from the producer for {now - self.last_rx:.1f} s ({why})")

    def _give_up_polls(self, now: float, timeout: float) -> None:
        """Every stream ended and a lag poll went unanswered for the timeout: the run is over,
        not the connection dead; the poll is dropped and the connection finishes."""
        for opaque in list(self._polls):
            sent = self.link.sent_at.get(opaque)
            if sent is not None and now - sent[0] > timeout:
                self.link.pending.pop(opaque, None)
                self.link.sent_at.pop(opaque, None)
                self._polls.discard(opaque)
                self.seqnos_pending = max(0, self.seqnos_pending - 1)

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
        self.link.stamp_sent(now)

    def hold(self, now: float) -> None:
        """We are holding reads back (flow control towards our writer): the silence and the
        waiting that follow are ours, so every clock restarts from now."""
        self.receiver.last_rx = now
        self.link.restart_clocks(now)

    def close_streams(self) -> None:
        """Ask the producer to close every open stream (Ctrl-C, --max-messages)."""
        self.streams.close_all()

    def flush_acks(self, check_pause: bool = True) -> bool:
        """Send the pending buffer ack if it is due and nothing asks us to pause; True if sent."""
        unacked = self.receiver.unacked
        if (self.buffer_active and unacked >= self.cfg.buffer_size * self.cfg.ack_ratio
                and not (check_pause and self.should_pause is not None and self.should_pause())):
            self.link.send(m.BufferAck(bytes_acked=unacked))
            self.acked_total += unacked
            self.receiver.unacked = 0
            return True
        return False

    # ---- introspection
    def open_streams(self) -> int:
        return self.streams.open_count()

    def last_seqno(self, vb: int, sid: int = 0) -> int:
        return self.streams.held_last(stream_key(vb, sid))

    def describe_end(self, reason: int) -> str:
        return stream_end_reason_name(reason)
