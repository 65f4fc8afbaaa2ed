"""`dcptool stream couchbase://...`: the DCP session `capture` runs (capture/dcp_session.py)
with the rows of every frame that crosses the wire, both directions (live/dcp_rows.py's
RowTap, capture/dcp_tap.py's tap), printed; consumer events as lines on stderr (EventLog,
`capture`'s too)."""

from __future__ import annotations

import json

from dcptool.capture import dcp_session as S
from dcptool.capture.lag import DcpWatch
from dcptool.capture.options import LiveOptions
from dcptool.capture.run import (
    MAX_MESSAGES,
    RunStats,
    StopSignals,
    unserved_error,
    unserved_fields,
)
from dcptool.cli.exit_codes import Interrupted
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import Sink, default_format, markup_safe
from dcptool.cli.view.run_summary import (
    add_rates,
    live_view,
    print_stream_summary,
    run_and_close,
    stream_sink,
)
from dcptool.live.dcp_rows import RowTap
from dcptool.live.stdout_pipe import OutputStalled, note_stop_signals, run_deadline
from dcptool.live.view_filter import RowFilter
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client import manifest as dcp_collections
from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer_api import FilterResolved
from dcptool.protocol.dcp.wire.constants import status_name, stream_end_reason_name
from dcptool.replay.display import display_columns

TABLE_COLUMNS = ["conn", "direction", "op", "vbucket", "status", "opaque", "by_seqno", "key", "value_len",
                 "snap_start", "snap_end", "snap_flag_names", "stream_end_reason", "rollback_seqno"]


class EventLog:
    """Consumer events as one line each on stderr: the `tell` of capture/dcp_session.py's DcpEvents,
    which keeps the run's state."""

    def __init__(self, quiet: bool = False):
        self.console = err_console()
        self.quiet = quiet
        self.filter_said = False
        self.notes: dcp_collections.EventNotes | None = None   # the run's RowTap's

    def __call__(self, e, state: S.DcpEvents) -> None:
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


def view_columns(view: RowFilter, values: bool) -> list[str]:
    """The live table's columns: `ts` (where it costs no line) and TABLE_COLUMNS; the view
    of the stream's own rows (no -v) leaves out `direction`, `opaque`, `status` and
    `rollback_seqno` (`in`, the stream's opaque, or empty in every row it prints)."""
    cols = ["ts", *TABLE_COLUMNS]
    if view.quiet:
        cols = [c for c in cols if c not in ("direction", "opaque", "status", "rollback_seqno")]
    return display_columns(cols, values)


def run_stream(opts: LiveOptions, ops: frozenset[str] | None = None, key: str | None = None) -> None:
    fmt = default_format(opts.fmt)
    view = live_view(fmt, opts, ops, key)
    sink = stream_sink(opts, lambda: Sink(fmt, columns=view_columns(view, opts.values) if fmt in ("table",) else None,
                                          live=True, optional=frozenset({"ts"}),
                                          first_widths=None if view.quiet else {"op": len("get_cluster_config")}))
    lines = EventLog()
    events = S.DcpEvents(requested=opts.vbuckets, tell=lines, on_map=add_node_column(sink))
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
                 on_limit=stop, stats=stats, say=lambda line: err_console().print(markup_safe(line), highlight=False))
    tap.view = view
    if opts.collections:
        tap.notes = lines.notes = dcp_collections.EventNotes()
    session = S.make_session(opts, tap=tap, on_events=watch.chain(events, tap), on_connect=watch.connected)
    session_box["session"] = session
    run_deadline(opts.duration)
    tap.watch = watch.start(unserved=lambda: len(events.unserved), say=lambda t: err_console().print(t, markup=False))
    with StopSignals() as signals:
        consumer, error = run_and_close(lambda: S.run_session(session, opts.duration, stats, signals, before_stop=
                                                            watch.final, on_attach=note_stop_signals), sink)
        watch.close()
        if error is None and consumer is not None and not session.stopped:
            stats.stop(S.finish_reason(opts, events))
            opened = set(events.ends) | {vb for vb in consumer.vb_states() if vb not in events.failed}
            if events.failed and not opened:
                error = S.every_stream_failed(events)
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
