"""`dcptool stream couchbase://...`: runs the DCP consumer (protocol/dcp/client/consumer.py) over
the asyncio transport (protocol/transport/dcp_client.py) and prints every frame that crosses the
wire, both directions, as CAPTURE_FORMAT rows plus `direction` and `ts`. Each receive
batch is decoded at once by the columnar decoder (replay/rows.py), the same as `decode`.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from dcptool.capture.dcp import (
    DcpEvents,
    every_stream_failed,
    finish_reason,
    make_session,
    run_session,
)
from dcptool.capture.lag import DcpWatch
from dcptool.capture.options import LiveOptions
from dcptool.capture.run import (
    MAX_MESSAGES,
    RunStats,
    StopSignals,
    unserved_error,
    unserved_fields,
)
from dcptool.capture.stdout_pipe import OutputStalled, note_stop_signals, run_deadline
from dcptool.cli.errors import Interrupted
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import Sink, default_format, iso_ns, markup_safe
from dcptool.cli.view.run_summary import (
    add_rates,
    print_stream_summary,
    run_and_close,
    stream_sink,
)
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client import manifest as dcp_collections
from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer_api import FilterResolved
from dcptool.protocol.dcp.wire.constants import (
    Status,
    status_name,
    stream_end_reason_name,
)
from dcptool.replay.display import display_columns
from dcptool.replay.rows import frame_columns, jsonl_of, row_columns, rows_of

TABLE_COLUMNS = ["conn", "direction", "op", "vbucket", "status", "opaque", "by_seqno", "key", "value_len",
                 "snap_start", "snap_end", "snap_flag_names", "stream_end_reason", "rollback_seqno"]

_ONE_OFFSET = np.zeros(1, np.int64)   # a frame we send is a batch of one
# Knobs tests turn down.
DEFAULTS = {"reconnects": 3}   # the connect bound is --timeout


class RowTap:
    """Turns every frame into a row for the sink (every row carries every column of
    row_columns(), absent fields None); stops after max_messages received and counts what it
    showed in `stats` (this run's summary)."""

    def __init__(self, sink: Sink, *, values: bool, raw: bool, max_messages: int | None,
                 on_limit=None, stats: RunStats | None = None):
        self.sink = sink
        self.values = values
        self.raw = raw
        self.remaining = max_messages
        self.on_limit = on_limit
        self.consumer: dcp_consumer.Consumer | None = None
        self.conn = 0
        self.node: str | None = None
        self.frame_no = 0
        self.stats = stats if stats is not None else RunStats("dcp", "")
        self.template = dict.fromkeys(row_columns(values, raw))
        # DCP-specific counts of the rows shown
        self.items = 0
        self.streams_ended = 0
        self.rollbacks = 0
        self.ops: dict[str, int] = {}
        self.notes = None              # collections.EventNotes when collections are on
        self.watch: DcpWatch | None = None   # --metrics: told every receive batch (capture/lag.py)

    @property
    def received(self) -> int:
        return self.stats.messages_in

    @property
    def sent(self) -> int:
        return self.stats.messages_out

    def attach(self, conn: int, consumer: dcp_consumer.Consumer, node: str | None = None) -> None:
        self.conn, self.consumer, self.node = conn, consumer, node

    def _vb_of(self, opaque: int):
        return self.consumer.link.vb_opaque.get(opaque) if self.consumer is not None else None

    def columns(self, buf, offsets, lengths, ts: str, direction: str, mono_ns: int | None = None):
        """Display columns of whole frames (replay/rows.py: the columnar decoder), numbered."""
        cols, n = frame_columns(buf, offsets, lengths, template=self.template,
                                collections=self.consumer.handshake.collections if self.consumer is not None else False,
                                opaque_vbuckets=self.consumer.link.vb_opaque if self.consumer is not None else {},
                                values=self.values, raw=self.raw,
                                extra={"conn": self.conn, "node": self.node, "ts": ts, "mono_ns": mono_ns, "direction": direction},
                                first_frame_no=self.frame_no)
        self.frame_no += n
        return cols, n

    def rows(self, buf, offsets, lengths, ts: str, direction: str, mono_ns: int | None = None) -> list[dict]:
        return rows_of(*self.columns(buf, offsets, lengths, ts, direction, mono_ns), self.template)

    def _write(self, cols: dict, n: int) -> None:
        """Counts what is shown (this run's summary) and writes it."""
        counts = Counter(cols["op"])     # counted in C, not per row in Python
        ops = self.ops
        for op, k in counts.items():
            ops[op] = ops.get(op, 0) + k
        self.items += counts["mutation"] + counts["deletion"] + counts["expiration"]
        self.streams_ended += counts["stream_end"]
        if counts["stream_req"]:
            self.rollbacks += sum(1 for op, status, direction in zip(cols["op"], cols.get("status") or [None] * n,
                                                                     cols["direction"])
                                  if op == "stream_req" and status == Status.ROLLBACK and direction == "in")
        fmt = getattr(self.sink, "fmt", None)
        if fmt == "none":      # stream --json without --format: counted only
            self.sink.count += n
        elif fmt == "jsonl":
            self.sink.write_jsonl(jsonl_of(cols, n, self.template), n)
        else:
            self.sink.write_many(rows_of(cols, n, self.template))

    def on_received(self, buf, offsets, lengths, ts_ns: int, mono_ns: int) -> None:
        if self.remaining is not None and self.remaining <= 0:
            return
        if self.remaining is not None and len(offsets) > self.remaining:
            offsets, lengths = offsets[:self.remaining], lengths[:self.remaining]
        n = len(offsets)
        if n and self.watch is not None:
            self.watch.received(buf, offsets, lengths, self.conn, self.node, self.consumer)
        if n:
            self._write(*self.columns(buf, offsets, lengths, iso_ns(ts_ns), "in", mono_ns))
            if self.notes is not None:    # collection system events, told once each on stderr
                for line in self.notes.lines(buf, offsets, lengths):
                    err_console().print(markup_safe(line), highlight=False)
        st = self.stats
        st.messages_in += n
        st.bytes_in += int(lengths.sum())
        if self.remaining is not None:
            self.remaining -= n
            if self.remaining <= 0 and self.on_limit is not None:
                self.on_limit()

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self.stats.connections = max(self.stats.connections, self.conn)   # sending HELLO: it was made
        if self.remaining is not None and self.remaining <= 0:
            return
        self.stats.messages_out += 1
        self.stats.bytes_out += len(frame)
        self._write(*self.columns(frame, _ONE_OFFSET, np.array([len(frame)]), iso_ns(ts_ns), "out", mono_ns))


class EventLog:
    """Consumer events as one line each on stderr: the `tell` of capture/dcp.py's DcpEvents,
    which keeps the run's state."""

    def __init__(self, quiet: bool = False):
        self.console = err_console()
        self.quiet = quiet
        self.filter_said = False
        self.notes = None              # collections.EventNotes of the run's RowTap

    def __call__(self, e, state: DcpEvents) -> None:
        t = type(e)
        if t is dcp_consumer.ControlRefused:
            self._say(f"[yellow]DCP_CONTROL {e.key}={e.value} refused[/] ({status_name(e.status)}); continuing")
        elif t is dcp_consumer.Rollback:
            self._say(f"vbucket {e.vbucket}: ROLLBACK to seqno {e.seqno}; re-requesting")
        elif t is dcp_consumer.StreamFailed:
            if e.status != 0x07 or len(state.failed) <= 3:
                self._say(f"[yellow]vbucket {e.vbucket}: stream request failed[/] ({status_name(e.status)})")
        elif t is routing.MapApplied:
            if state.new_nodes and len(e.nodes) > 1:
                self._say(f"cluster map rev {e.rev_epoch}/{e.rev}: {len(e.nodes)} nodes "
                          f"({markup_safe(', '.join(e.nodes))})")
        elif t is dcp_consumer.NotMyVbucket:
            self._say(f"vbucket {e.vbucket}: NOT_MY_VBUCKET; following the cluster map")
        elif t is FilterResolved and not self.filter_said:
            self._filter_resolved(e)
        elif t is dcp_consumer.PushIgnored:
            self._say(f"[yellow]server request ignored[/]: {markup_safe(e.reason)}")
        elif t is routing.Rerouted:
            self._say(f"vbucket {e.vbucket}: now streamed from {markup_safe(e.node)}")
        elif t is routing.Unserved:
            self._say(f"[red]vbucket {e.vbucket}: not served[/]: {e.reason}")
        elif t is dcp_consumer.StreamEnded and e.reason and e.reason != 1:   # 1: closed because we asked
            again = "" if e.final else "; re-requesting"
            self._say(f"vbucket {e.vbucket}: stream end ({stream_end_reason_name(e.reason)}){again}")

    def _filter_resolved(self, e) -> None:
        self.filter_said = True
        if e.filters:   # --stream-ids: one filter per stream id
            self._say("stream ids: " + "; ".join(
                f"{sid} {markup_safe(json.dumps(f or 'all', separators=(',', ':')))}"
                for sid, f in enumerate(e.filters, 1)))
        else:
            self._say(f"collection filter {markup_safe(json.dumps(e.filter, separators=(',', ':')))}")
        if e.manifest_raw and self.notes is not None:
            self.notes.manifest = dcp_collections.parse_manifest(e.manifest_raw)

    def _say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False)


def add_node_column(sink):
    """A table gets a `node` column after `conn` once the map has more than one node."""
    def on_map(nodes):
        cols = sink.columns
        if len(nodes) > 1 and cols is not None and "node" not in cols and "conn" in cols:
            cols.insert(cols.index("conn") + 1, "node")
    return on_map


def run_stream(opts: LiveOptions) -> None:
    fmt = default_format(opts.fmt)
    sink = stream_sink(opts, lambda: Sink(fmt, columns=display_columns(TABLE_COLUMNS, opts.values)
                                          if fmt in ("table",) else None))
    lines = EventLog()
    events = DcpEvents(requested=opts.vbuckets, tell=lines, on_map=add_node_column(sink))
    stats = RunStats("dcp", opts.source.url)
    session_box: dict = {}
    watch = DcpWatch(opts.metrics, opts.lag_interval)

    def stop():
        stats.stop(MAX_MESSAGES)
        s = session_box.get("session")
        if s is not None:
            watch.final()
            s.stop()

    tap = RowTap(sink, values=opts.values, raw=opts.raw, max_messages=opts.max_messages,
                 on_limit=stop, stats=stats)
    if opts.collections:
        tap.notes = lines.notes = dcp_collections.EventNotes()
    session = make_session(opts, tap=tap, on_events=watch.chain(events, tap), on_connect=watch.connected,
                           reconnects=DEFAULTS["reconnects"])
    session_box["session"] = session
    run_deadline(opts.duration)
    tap.watch = watch.start(unserved=lambda: len(events.unserved), say=lambda t: err_console().print(t, markup=False))
    with StopSignals() as signals:
        consumer, error = run_and_close(lambda: run_session(session, opts.duration, stats, signals, before_stop=
                                                            watch.final, on_attach=note_stop_signals), sink)
        watch.close()
        if error is None and consumer is not None and not session.stopped:
            stats.stop(finish_reason(opts, events))
            opened = set(events.ends) | {vb for vb in consumer.vb_states() if vb not in events.failed}
            if events.failed and not opened:
                error = every_stream_failed(events)
        interrupted = signals.interrupted()
        if error is None and interrupted is not None:
            error = interrupted
        if events.streaming or isinstance(error, (Interrupted, OutputStalled)) or stats.stopped == MAX_MESSAGES:
            summary = stats.summary(error)
            summary.update(items=tap.items, streams_ended=tap.streams_ended, rollbacks=tap.rollbacks,
                           failed_streams=len(events.failed), **unserved_fields(events.unserved),
                           **watch.summary_fields())
            add_rates(summary, tap.ops)
            if not isinstance(error, BrokenPipeError):
                print_stream_summary(summary, opts)
    if error is None and events.unserved:
        error = unserved_error(events.unserved)
    if error is not None:
        raise error
