"""Lag polls of a DCP run (`--lag-interval`, docs/CLI.md "Metrics and lag"): on each streaming
connection once as soon as every one of its streams is open (the gauge has every vbucket from
the first scrape), then every interval, it asks GET_ALL_VB_SEQNOS for its node's active
vbuckets (consumer.polls.request()), and once more when the run ends (a stop, or the last
stream of a connection ending). The request and its answer cross the wire like any frame,
so a capture records them and `replay --table lag` (replay/rules/lag.py) computes the lag
afterwards, by the same definition as the live answers (VbSeqnos.lags), which feed the
metrics (high seqnos, lag) and the largest lag the summary names.

Runs on the event loop thread only: the timer is a loop.call_later, the answers come as
consumer events."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import numpy as np

from dcptool.capture.metrics import LiveMetrics, MetricsServer, start
from dcptool.protocol.dcp.client.consumer_api import (
    StreamEnded,
    StreamFailed,
    StreamOpened,
    VbSeqnos,
)
from dcptool.replay.timestamps import iso_ns

if TYPE_CHECKING:
    from dcptool.protocol.dcp.client.consumer import Consumer


class LagPoller:
    """`interval` seconds between polls (0: no polls at all). `connected(conn, consumer)` as
    each connection is made; `events(evs, consumer)` with the consumer's events;
    `final()` before the run's streams are closed."""

    def __init__(self, interval: float, metrics=None):
        self.interval = interval or 0.0
        self.metrics = metrics
        self.consumers: dict[int, Consumer] = {}
        self.asked_final: set[int] = set()
        self.first: set[int] = set()           # connections that had their first poll (streams open)
        self.high_seqnos: dict[int, int] = {} if metrics is None else metrics.high_seqnos
        self.lags: dict[int, int] = {} if metrics is None else metrics.lags
        self.largest: tuple | None = None      # (lag_items, vbucket, ts_ns) of the largest lag seen
        self.polls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def connected(self, conn: int, consumer) -> None:
        if not self.enabled:
            return
        self.consumers[conn] = consumer
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._timer = self._loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        self.poll()
        assert self._loop is not None, "connected() set it before the first tick"
        self._timer = self._loop.call_later(self.interval, self._tick)

    @staticmethod
    def _live(c: Consumer) -> bool:
        return c.streaming

    def poll(self) -> None:
        """Ask every streaming connection (sent with its next flush, within half a second)."""
        for c in list(self.consumers.values()):
            if self._live(c):
                c.polls.request()
                self.polls += 1

    def final(self) -> None:
        """The run is about to stop: one more poll on each live connection, asked before the
        streams are closed so it is answered before they end."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for conn, c in list(self.consumers.items()):
            if self._live(c) and conn not in self.asked_final:
                self.asked_final.add(conn)
                c.polls.request()
                self.polls += 1

    def events(self, evs, consumer, conn: int | None = None) -> None:
        """The consumer's events: answers update the high seqnos and the largest lag; the last
        stream of a connection ending asks its final poll (answered before it closes)."""
        if not self.enabled or consumer is None:
            return
        ended = opened = False
        for e in evs:
            t = type(e)
            if t is VbSeqnos:
                self._answer(e)
            elif t is StreamEnded:
                ended = True
            elif t is StreamOpened or t is StreamFailed:
                opened = True
        key = conn if conn is not None else id(consumer)
        if opened and key not in self.first and consumer.streaming and not consumer.streams.opening:
            self.first.add(key)         # every stream of the connection answered: poll right away
            consumer.polls.request()
            self.polls += 1
        if ended and consumer.handshake.streaming and consumer.streams.finished and not consumer.polls.pending:
            if key not in self.asked_final:
                self.asked_final.add(key)
                consumer.polls.request()
                self.polls += 1

    def _answer(self, e: VbSeqnos) -> None:
        """The one definition of lag (CLI.md "Lag"; the `lag` table's, replay/rules/lag.py):
        per vbucket of the answer that the connection streams, high seqno - the seqno it stood
        at when the answer was read, never below 0."""
        now = time.time_ns()
        for vb, high, _, lag in e.lags():
            self.high_seqnos[vb] = high
            self.lags[vb] = lag
            if self.largest is None or lag > self.largest[0]:
                self.largest = (lag, vb, now)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def summary_fields(self) -> dict:
        """The summary's largest lag (none without polls)."""
        if not self.enabled or self.largest is None:
            return {}
        lag, vb, ts = self.largest
        return {"largest_lag_items": lag, "largest_lag_vbucket": vb, "largest_lag_at": iso_ns(ts)}


class DcpWatch:
    """What `--metrics` and `--lag-interval` add to a DCP run, `capture` and `stream` alike:
    the live numbers (capture/metrics.py) and their endpoint, and the lag polls. The run calls
    `start()` before it connects (a --metrics address in use is a usage error then),
    `connected` from its on_connect, `received` from its tap (once per receive batch),
    `events` after its DcpEvents counted a batch of events, `final()` before it stops its
    streams, and `close()` at the end."""

    def __init__(self, metrics_listen: str | None, lag_interval: float):
        self.listen = metrics_listen
        self.live = LiveMetrics("dcp") if metrics_listen else None
        self.lag = LagPoller(lag_interval, self.live)
        self.positions: dict[int, int] = {}     # vbucket -> last seqno, every connection's
        self.server: MetricsServer | None = None
        self._next = 0.0

    def start(self, *, segments=None, queue_depth=None, unserved=None, say=None) -> "DcpWatch | None":
        """Serve the metrics (when asked); `say(text)` hears where. Returns self when the
        tap must report its receive batches (--metrics), else None."""
        if self.live is None:
            return None
        live = self.live
        live.seqnos = lambda: self.positions
        for name, fn in (("segments", segments), ("queue_depth", queue_depth), ("unserved", unserved)):
            if fn is not None:
                setattr(live, name, fn)
        server = self.server = start(self.listen, live)
        if say is not None:
            assert server is not None, "self.live: --metrics was given"
            say(f"metrics: {server.url}")
        return self

    @property
    def url(self) -> str | None:
        """Where the metrics are served (the port a --metrics HOST:0 got), or None."""
        return None if self.server is None else self.server.url

    def connected(self, conn: int, consumer) -> None:
        self.lag.connected(conn, consumer)

    def chain(self, on_events, tap):
        """An on_events that calls `on_events` (a DcpEvents), then hears the events itself;
        `tap` says which connection they came from (tap.consumer, tap.conn)."""
        def both(evs) -> None:
            on_events(evs)
            self.events(evs, tap.consumer, tap.conn, on_events)
        return both

    def received(self, buf, offsets, lengths, conn: int, node: str | None, consumer) -> None:
        live = self.live
        if live is None:
            return
        live.connected(conn, node)
        u8 = np.frombuffer(buf, dtype=np.uint8)
        live.count_batch(u8[np.asarray(offsets) + 1], np.asarray(lengths))
        now = time.monotonic()
        if consumer is not None and now >= self._next:   # positions: as often as the progress line
            self._next = now + 0.25
            self.positions.update(consumer.streams.positions())

    def events(self, evs, consumer, conn: int | None, dcp_events=None) -> None:
        self.lag.events(evs, consumer, conn)
        if self.live is not None and dcp_events is not None:
            self.live.rollbacks = dcp_events.rollbacks
            if consumer is not None and any(type(e) is VbSeqnos for e in evs):
                self.positions.update(consumer.streams.positions())

    def final(self) -> None:
        """The run is asked to stop: the last lag poll goes out before its streams close."""
        self.lag.final()

    def close(self) -> None:
        self.lag.close()
        if self.server is not None:
            self.server.close()
            self.server = None

    def summary_fields(self) -> dict:
        return self.lag.summary_fields()
