"""A DCP session as `capture` and `stream` both run it, with one set of settings: the
consumer's config from LiveOptions (the one default connection name, capture/options.py
default_name), the session over the transport (the one reconnect count, DEFAULTS), its event
loop (run_session: until it ends, a duration passes or a signal comes), and the consumer's
events as the run's state (DcpEvents). capture/dcp_capture.py adds the writer, live/dcp_rows.py the
rows of `stream`; both hand the session a tap of capture/dcp_tap.py."""

from __future__ import annotations

import ssl
from typing import Any, Callable, Iterable

from dcptool.capture.options import LiveOptions, default_name
from dcptool.capture.run import (
    END,
    TO,
    RunStats,
    StopSignals,
    check_vbuckets,
    run_until_stopped,
)
from dcptool.capture.shard import parse_shard, shard_name, shard_vbuckets
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer_api import FilterUnknown
from dcptool.protocol.dcp.wire.constants import status_name
from dcptool.protocol.errors import ErrorCode, LateUsageError, RemoteError
from dcptool.protocol.transport.dcp_client import tls_context
from dcptool.protocol.transport.dcp_cluster import ClusterSession

# The settings of every DCP run (tests turn them down); the connect bound is --timeout.
DEFAULTS = {"reconnects": 5}


def consumer_config(opts: LiveOptions) -> dcp_consumer.ConsumerConfig:
    src = opts.source
    return dcp_consumer.ConsumerConfig(
        bucket=src.bucket or "", name=shard_name(opts.name or default_name(src), opts.shard),
        user=opts.user,
        password=opts.password, vbuckets=shard_vbuckets(opts), start=opts.from_, to=opts.to,
        no_value=opts.no_value, xattrs=opts.xattrs, collections=opts.collections,
        buffer_size=opts.buffer_size, noop_interval=opts.noop_interval, timeout=opts.timeout, tls=src.tls,
        allow_plain=opts.sasl_plain, check_vbuckets=opts.vbuckets is not None,
        compress=opts.compress, sync_writes=opts.sync_writes, expiry_opcode=opts.expiry_opcode,
        ack_ratio=opts.ack_ratio, required=frozenset(opts.required_controls), change_streams=opts.change_streams,
        oso=opts.oso,
        scopes=tuple(opts.scopes), collection_names=tuple(opts.collection_names),
        stream_filter=opts.stream_filter, stream_ids=opts.stream_ids, stream_groups=tuple(opts.stream_groups),
        stream_filters=None if opts.stream_filters is None else tuple(opts.stream_filters),
        shard=parse_shard(opts.shard))


def tls_for(opts: LiveOptions) -> ssl.SSLContext | None:
    if not opts.source.tls:
        return None
    return tls_context(opts.ca_cert, opts.insecure)


def make_session(opts: LiveOptions, **kw: Any) -> ClusterSession:
    """The session of a DCP run: the seeds of the source, a cluster map followed when the
    server has one (protocol/transport/dcp_cluster.py), else one node; a lost connection is
    made again DEFAULTS["reconnects"] times, for `stream` and `capture` alike."""
    return ClusterSession(consumer_config(opts), opts.source.seed_list, tls=tls_for(opts),
                          connect_timeout=opts.timeout, conn_per_node=opts.conn_per_node,
                          config_poll=opts.config_poll, reconnects=DEFAULTS["reconnects"], **kw)


def run_session(session: ClusterSession, duration: float | None, stats: RunStats | None = None,
                signals: StopSignals | None = None, on_attach: Callable[[], None] | None = None,
                before_stop: Callable[[], None] | None = None) -> dcp_consumer.Consumer | None:
    """Run a transport Session on a fresh event loop until it ends, `duration` passes, or a
    signal (SIGINT, SIGTERM, SIGHUP through `signals`) asks it to close its streams. Returns
    the consumer (None when a signal came before it started); the reason is in `stats`.
    `before_stop()` runs first when a stop is asked (the last lag poll, capture/lag.py)."""
    stats = stats if stats is not None else RunStats("dcp", "")

    def request_stop(reason: str) -> None:
        stats.stop(reason)
        if before_stop is not None and not session.stopped:
            before_stop()
        session.stop()

    consumer: dcp_consumer.Consumer | None = run_until_stopped(
        session.run, request_stop, stats, duration=duration, signals=signals,
        when_cancelled=lambda: session.consumer, on_attach=on_attach)
    return consumer


class DcpEvents:
    """The consumer's events as the state of a run: streams failed and ended, rollbacks,
    vbuckets a cluster could not serve, the nodes of the map. A --vbuckets beyond the
    bucket's or a filter naming unknown collections raises LateUsageError. `tell(event,
    self)` is called after each event is counted (the CLI prints a line for some);
    `on_map(nodes)` with the node list of each newer cluster map."""

    def __init__(self, requested: list[int] | None = None,
                 tell: Callable[[Any, DcpEvents], None] | None = None,
                 on_map: Callable[[tuple[str, ...]], None] | None = None):
        self.requested = requested     # --vbuckets, checked against the server's vbuckets
        self.tell = tell
        self.on_map = on_map
        self.unserved: dict[int, str] = {}
        self.nodes: tuple[str, ...] = ()
        self.new_nodes = False         # the last map's nodes differ from the one before
        self.failed: dict[int, int] = {}
        self.rollbacks = 0
        self.ends: dict[int, int] = {}
        self.streaming = False         # a handshake completed: the run reached its streams

    def __call__(self, events: Iterable[Any]) -> None:
        for e in events:
            self.count(e)
            if self.tell is not None:
                self.tell(e, self)

    def count(self, e: Any) -> None:
        t = type(e)
        if t is dcp_consumer.ServerVbuckets:
            check_vbuckets(self.requested, e.vbuckets)
        elif t is dcp_consumer.HandshakeComplete:
            self.streaming = True
        elif t is dcp_consumer.Rollback:
            self.rollbacks += 1
        elif t is dcp_consumer.StreamFailed:
            self.failed[e.vbucket] = e.status
        elif t is routing.MapApplied:
            self.new_nodes = e.nodes != self.nodes
            self.nodes = e.nodes
            if self.on_map is not None:
                self.on_map(e.nodes)
        elif t is FilterUnknown:
            raise LateUsageError(e.message)
        elif t is routing.Unserved:
            self.unserved[e.vbucket] = e.reason
        elif t is dcp_consumer.StreamEnded:
            self.ends[e.vbucket] = e.reason


def finish_reason(opts: LiveOptions, events: DcpEvents) -> str:
    """Why a DCP run that nobody stopped ended: every stream reached --to, or the server
    ended them."""
    if opts.to != "forever" and not events.failed and all(r == 0 for r in events.ends.values()):
        return TO
    return END


def every_stream_failed(events: DcpEvents) -> RemoteError:
    status = next(iter(events.failed.values()))
    return RemoteError(ErrorCode.STATUS, f"every stream request failed, e.g. vbucket "
                       f"{next(iter(events.failed))}: {status_name(status)}", status)
