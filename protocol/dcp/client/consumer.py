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

The consumer is a composition of parts that each own their state and change only their own
fields (tests/test_architecture.py checks it): the shared Link (link.py: configuration, frames
out, events, pending requests and the clock), the Handshake (handshake.py: the connection's
phase, features, controls), the Streams (streams.py: per-stream phases, positions, requests,
rollbacks, OSO), the Receiver (consumer_receive.py: the hot path for data frames, server
requests such as cluster-map change notifications, what is not acknowledged yet) and the
LagPolls (lag_polls.py). The phases and their moves are tables (phases.py). This class holds
the parts together and does what takes more than one of them; a caller uses a part directly
for what is that part's (`consumer.handshake.features`, `consumer.streams.vb_states()`,
`consumer.receiver.data_frames`, `consumer.polls.request()`).

Streams are keyed by consumer_api.stream_key(vbucket, stream id): the vbucket itself without
stream ids; with them (enable_stream_id) one stream per vbucket and group, sids 1..n, each with
its own state, filter and opaque. What goes in and out (resume, adopt, take_states,
resume_state, vb_states) stays per vbucket: a VbState whose `streams` holds the per-sid states.
"""

from __future__ import annotations

from typing import Any, Callable

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
from dcptool.protocol.dcp.client.lag_polls import LagPolls
from dcptool.protocol.dcp.client.link import Link
from dcptool.protocol.dcp.client.phases import ConnPhase, StreamPhase
from dcptool.protocol.dcp.client.streams import Streams
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Feature
from dcptool.protocol.dcp.wire.frames import split_until_error
from dcptool.protocol.errors import ErrorCode, RemoteError

# the consumer's API is importable from here (consumer_api.py holds the definitions)
__all__ = ["Consumer", "ConsumerConfig", "VbState", "DEFAULT_REOPEN", "NUM_VB_SLOTS", "ConfigReceived",
           "ControlRefused", "Finished", "Handoff", "HandshakeComplete", "NotMyVbucket", "Rollback",
           "ServerVbuckets", "StreamEnded", "StreamFailed", "StreamOpened", "VbSeqnos", "ConfigPushed", "PushIgnored",
           "DATA_OPS", "STREAM_OPS", "ConnPhase", "StreamPhase"]


# HELLO asks for these with Duplex: the server pushes each new cluster map (0x0d, whole)
NOTIFY_FEATURES = (Feature.CLUSTERMAP_CHANGE_NOTIFICATION,)


class Consumer:
    def __init__(self, config: ConsumerConfig, resume: dict[int, VbState] | None = None, now: float = 0.0):
        self.link = Link(config, now)
        self.handshake = Handshake(self.link, on_ready=self._on_ready)
        self.streams = Streams(self.link, resume, self.handshake.stream_value_of)
        self.receiver = Receiver(self.link, self.streams, lambda: self.handshake.collections, now)
        self.polls = LagPolls(self.link, self.streams.positions)
        self.should_pause: Callable[[], bool] | None = None
        self._tail = b""

    def _on_ready(self) -> None:
        self.streams.start()

    @property
    def finished(self) -> bool:
        """Every stream ended or failed and no lag poll waits for its answer."""
        return self.streams.finished and not self.polls.pending

    @property
    def streaming(self) -> bool:
        """The handshake is complete, the streams not all ended and not being closed: the
        connection can take more work (vbuckets, polls)."""
        return self.handshake.streaming and not self.finished and not self.streams.closing

    def vb_states(self) -> dict[int, VbState]:
        """The live state per vbucket (with stream ids: a summary holding each stream's). A
        run's result, a consumer or a cluster session's ClusterResult, answers this alike."""
        return self.streams.vb_states()

    # ---- bytes and time in, frames out
    def start(self, now: float) -> None:
        """Queue the first request (HELLO)."""
        self.link.at(now)
        self.receiver.heard(now)
        cfg = self.link.cfg
        feats = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.SNAPPY, Feature.DUPLEX,
                 Feature.TCP_NODELAY, *NOTIFY_FEATURES]
        if cfg.xattrs:
            feats.append(Feature.XATTR)
        if cfg.collections:
            feats.append(Feature.COLLECTIONS)
        self.handshake.start(feats)

    def outgoing(self) -> list[bytes]:
        return self.link.take_out()

    def receive(self, buf: Any, offsets: Any, lengths: Any, now: float) -> list[Any]:
        """Process the whole frames at offsets/lengths in buf (consumer_receive.py). Returns the events."""
        if len(offsets):
            self.receiver.receive(buf, offsets, lengths, now)
            self.flush_acks()
        return self.link.take_events()

    def feed(self, data: bytes, now: float) -> list[Any]:
        """Convenience: split data (with any kept tail) into frames and receive them."""
        buf = self._tail + bytes(data)
        bounds, consumed, err = split_until_error(buf)
        self._tail = buf[consumed:]
        ev = self.receive(buf, [o for o, _ in bounds], [n for _, n in bounds], now)
        if err is not None:
            raise err
        return ev

    def check(self, now: float) -> None:
        """Raise RemoteError(TIMEOUT) when a request has waited longer than the timeout for
        its answer, RemoteError(DEAD_CONNECTION) when a streaming connection is silent for
        longer than its idle limit (Handshake.idle_limit())."""
        self.link.at(now)
        cfg = self.link.cfg
        timeout = cfg.timeout
        if timeout and self.polls.pending and self.streams.finished:
            self.polls.give_up(now, timeout)
        oldest = self.link.oldest_pending() if timeout else None
        if oldest is not None and now - oldest[0] > timeout:
            raise RemoteError(ErrorCode.TIMEOUT, f"no answer to {oldest[1]} from the server within "
                              f"{timeout:g} s (--timeout)")
        # ended: only a lag poll can be waiting
        limit = None if self.streams.finished else self.handshake.idle_limit()
        last_rx = self.receiver.last_rx
        if limit is not None and now - last_rx > limit:
            why = (f"noop interval {cfg.noop_interval:g} s" if self.handshake.noop_active else
                   f"the server refused noops: idle limit max(2 x noop interval, --timeout {timeout:g} s)")
            raise RemoteError(ErrorCode.DEAD_CONNECTION,
                              f"no frame from the producer for {now - last_rx:.1f} s ({why})")

    def hold(self, now: float) -> None:
        """We are holding reads back (flow control towards our writer): the silence and the
        waiting that follow are ours, so every clock restarts from now."""
        self.receiver.heard(now)
        self.link.restart_clocks(now)

    def flush_acks(self, check_pause: bool = True) -> bool:
        """Send the pending buffer ack if it is due and nothing asks us to pause; True if sent."""
        cfg = self.link.cfg
        if (self.handshake.buffer_active and self.receiver.unacked >= cfg.buffer_size * cfg.ack_ratio
                and not (check_pause and self.should_pause is not None and self.should_pause())):
            self.link.send(m.BufferAck(bytes_acked=self.receiver.take_unacked()))
            return True
        return False

    def close_streams(self) -> None:
        """Ask the producer to close every open stream (Ctrl-C, --max-messages)."""
        self.streams.close_all()

    # ---- commands of a cluster session (transport/dcp_cluster.py)
    def route(self, vbuckets: list[int] | None, *, states: dict[int, VbState] | None = None,
              check: bool = False, handoff: bool = False) -> None:
        """After ConfigReceived(bootstrap=True): stream these vbuckets (None: every vbucket the
        server lists, as without a map) from `states` where given, and go on with DCP_OPEN."""
        self.link.reconfigure(vbuckets=None if vbuckets is None else list(vbuckets), check_vbuckets=check,
                              handoff=handoff, fetch_config=False)
        for vb, st in (states or {}).items():
            self.streams.adopt(vb, st)
        self.handshake.after_select()

    def add_vbuckets(self, states: dict[int, VbState]) -> None:
        """Stream these vbuckets too, from their states (a streaming connection, not finished)."""
        streaming = self.handshake.streaming
        for vb, st in states.items():
            self.streams.adopt(vb, st)
            if streaming:
                self.streams.add(vb)
            else:
                self.link.reconfigure(vbuckets=[*(self.link.cfg.vbuckets or ()), vb])
        if streaming:
            self.streams.pump()

    def take_states(self, vbuckets: Any) -> dict[int, VbState]:
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
        if not self.handshake.streaming:
            return list(self.link.cfg.vbuckets or ())
        return self.streams.unfinished()
