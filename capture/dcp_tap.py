"""The tap of a DCP session, one for `capture` and `stream`: the transport hands it every
frame that crosses the wire (attach, on_sent, on_received; protocol/transport/dcp_client.py), both
directions. DcpTap numbers the frames across connections, counts them in the run's RunStats,
keeps each connection's request opaques (so a response gets the vbucket of its request),
tells the --metrics / --lag-interval watch (capture/lag.py) of every receive and ends the run
through `on_limit` at --max-messages; what becomes of the frames is the subclass's
(write_sent / write_received): CaptureTap hands Arrow batches to the capture writer,
live/dcp_rows.py's RowTap turns them into rows for `stream`'s output.

--max-messages N differs on purpose (CLI.md): `stream` shows exactly N received frames
(`cut`: the rest of the batch and everything after is neither shown nor counted), `capture`
records everything that crossed the wire.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dcptool.capture.lag import DcpWatch
from dcptool.capture.run import RunStats
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.wire import columnar

if TYPE_CHECKING:   # types only: the writer brings pyarrow
    from dcptool.replay.store.background import BackgroundWriter

# Lazy imports: only where start-up time needs them. `stream` uses this module but never
# writes Arrow: the capture store's batch builder (pyarrow) is imported by CaptureTap only.


Buffer = bytes | bytearray | memoryview   # what the transport receives into


class DcpTap:
    """Every frame of a DCP session, numbered and counted (see the module's docstring);
    subclasses write them (write_sent, write_received) and may act before the connection
    changes (switching) and at the end (finish)."""

    cut = False   # --max-messages: stop showing and counting at the N-th received frame (stream)

    def __init__(self, *, max_messages: int | None = None, on_limit: Callable[[], None] | None = None,
                 watch: DcpWatch | None = None, stats: RunStats | None = None):
        self.stats = stats if stats is not None else RunStats("dcp", "")
        self.frame_no = 0
        self.conn = 0
        self.node: str | None = None
        self.consumer: dcp_consumer.Consumer | None = None
        self.opaque_vb: dict[int, Any] = {}       # this connection's: request opaque -> vbucket (or (vbucket, sid))
        self.opaque_vbs: dict[int, dict[int, Any]] = {}   # per connection (opaques repeat across them)
        self.remaining = max_messages
        self.on_limit = on_limit
        self.watch = watch              # --metrics / --lag-interval (capture/lag.py), or None

    @property
    def received(self) -> int:
        return self.stats.messages_in

    @property
    def sent(self) -> int:
        return self.stats.messages_out

    @property
    def collections(self) -> bool:
        return self.consumer.handshake.collections if self.consumer is not None else False

    # -- transport hooks
    def attach(self, conn: int, consumer: dcp_consumer.Consumer, node: str | None = None) -> None:
        if conn == self.conn and consumer is self.consumer and node == self.node:
            return
        self.switching()
        self.conn, self.consumer, self.node = conn, consumer, node
        self.opaque_vb = self.opaque_vbs.setdefault(conn, {})

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        st = self.stats
        st.connections = max(st.connections, self.conn)   # something was sent: it was made
        if self.cut and self.remaining is not None and self.remaining <= 0:
            return
        st.messages_out += 1
        st.bytes_out += len(frame)
        self.write_sent(frame, ts_ns, mono_ns)
        self.frame_no += 1

    def on_received(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts_ns: int, mono_ns: int) -> None:
        if self.cut and self.remaining is not None:
            if self.remaining <= 0:
                return
            if len(offsets) > self.remaining:
                offsets, lengths = offsets[:self.remaining], lengths[:self.remaining]
        n = len(offsets)
        if n == 0:
            return
        if self.watch is not None:
            self.watch.received(buf, offsets, lengths, self.conn, self.node, self.consumer)
        nbytes = int(lengths.sum())
        self.write_received(buf, offsets, lengths, ts_ns, mono_ns, nbytes)
        self.frame_no += n
        st = self.stats
        st.messages_in += n
        st.bytes_in += nbytes
        if self.remaining is not None:
            self.remaining -= n
            if self.remaining <= 0 and self.on_limit is not None:
                self.on_limit()

    # -- what the subclass does with the frames
    def write_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        """A frame we sent, numbered self.frame_no."""

    def write_received(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts_ns: int, mono_ns: int,
                       nbytes: int) -> None:
        """A receive batch, its first frame numbered self.frame_no."""

    def switching(self) -> None:
        """The tap is about to follow another connection."""

    def finish(self) -> None:
        """The session ended."""


class CaptureTap(DcpTap):
    """`capture`'s tap: every receive batch as one Arrow record batch for the background
    writer (replay/store/dcp_batch.py), the frames we sent gathered into one batch before the
    next receive; batches are held until the options metadata is final (release)."""

    def __init__(self, bg: BackgroundWriter, progress: Any, *, max_messages: int | None = None,
                 on_limit: Callable[[], None] | None = None, watch: DcpWatch | None = None,
                 stats: RunStats | None = None):
        super().__init__(max_messages=max_messages, on_limit=on_limit, watch=watch, stats=stats)
        from dcptool.replay.store.dcp_batch import (
            to_record_batch,  # pyarrow: see the top
        )
        self.to_batch = to_record_batch
        self.bg = bg
        self.progress = progress
        self._held: list[Any] | None = []    # batches held until the options metadata is final
        self._dropping = False               # discard(): nothing more is written
        self._out: list[tuple[int, bytes, int, int]] = []            # sent frames not yet in a batch: (frame_no, frame, ts, mono)
        self._next_progress = 0.0

    def write_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self._out.append((self.frame_no, frame, ts_ns, mono_ns))

    def write_received(self, buf: Buffer, offsets: np.ndarray, lengths: np.ndarray, ts_ns: int, mono_ns: int,
                       nbytes: int) -> None:
        self._flush_out()
        n = len(offsets)
        batch = columnar.decode_batch(buf, offsets, lengths, collections=self.collections,
                                      opaque_vbuckets=self.opaque_vb)
        rb = self.to_batch(batch, frame_no=np.arange(self.frame_no, self.frame_no + n, dtype=np.int64),
                           conn=self.conn, ts_ns=np.full(n, ts_ns, dtype=np.int64),
                           mono_ns=np.full(n, mono_ns, dtype=np.int64), direction=np.zeros(n, dtype=np.uint8),
                           node=self.node)
        self._submit(rb)
        self.progress.add(frames=n, wire_bytes=nbytes)
        now = time.monotonic()
        if now >= self._next_progress:
            self._next_progress = now + 0.25
            self._progress_details()

    def switching(self) -> None:
        self._flush_out()

    # -- batches
    @property
    def holding(self) -> bool:
        """Batches are held until the options metadata is final (the handshake's features)."""
        return self._held is not None

    def release(self) -> None:
        """The options metadata is final: everything held goes to the writer."""
        if self._dropping:
            return
        held, self._held = self._held, None
        for rb in held or ():
            self.bg.submit(rb)

    def discard(self) -> None:
        """Nothing of this run is to be written (another source than the directory's): what
        is held and whatever comes after is dropped."""
        self._held, self._dropping = [], True

    def _submit(self, rb: Any) -> None:
        if self._dropping:
            return
        if self._held is not None:
            self._held.append(rb)
        else:
            self.bg.submit(rb)

    def _flush_out(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        buf = b"".join(f for _, f, _, _ in out)
        lengths = np.array([len(f) for _, f, _, _ in out], dtype=np.int64)
        offsets = np.zeros(len(out), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        batch = columnar.decode_batch(buf, offsets, lengths, collections=self.collections,
                                      opaque_vbuckets=self.opaque_vb)
        rb = self.to_batch(batch, frame_no=np.array([x[0] for x in out], dtype=np.int64), conn=self.conn,
                           ts_ns=np.array([x[2] for x in out], dtype=np.int64),
                           mono_ns=np.array([x[3] for x in out], dtype=np.int64),
                           direction=np.ones(len(out), dtype=np.uint8), node=self.node)
        self._submit(rb)

    def finish(self) -> None:
        self._flush_out()
        self.release()

    def _progress_details(self) -> None:
        c = self.consumer
        if c is None:
            return
        states = c.streams.states
        ended = sum(1 for s in states.values() if s.ended_reason is not None)
        self.progress.update(streams_open=max(0, len(states) - ended), streams_ended=ended,
                             positions={vb: s.last_seqno for vb, s in c.vb_states().items()},
                             bytes_written=self.bg.writer.bytes_written, backlog_bytes=self.bg.backlog_bytes)
