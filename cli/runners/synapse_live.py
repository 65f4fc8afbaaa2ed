"""`dcptool stream|capture synapse://... | synapse+redis://...`: the capture is library
(capture/synapse_capture.py); `stream` runs the same client and transports with a handler that
prints what crosses the wire (live/synapse_rows.py); both tell gaps and reconnects on stderr."""

from __future__ import annotations

import time

from dcptool.capture import metrics, synapse_capture
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.run import END, MAX_MESSAGES, StopSignals
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import Sink, default_format, markup_safe
from dcptool.cli.view.progress import print_summary
from dcptool.cli.view.run_summary import (
    add_rates,
    live_view,
    print_stream_summary,
    run_and_close,
    stream_sink,
)
from dcptool.live.progress import fit_items
from dcptool.live.stdout_pipe import note_stop_signals, run_deadline
from dcptool.live.synapse_rows import StreamHandler
from dcptool.protocol.synapse.client import Gap

TABLE_COLUMNS = ["frame_no", "conn", "direction", "command", "stream", "instance", "token",
                 "detail"]


def tell(ev) -> None:
    """A gap or a reconnect as one line on stderr."""
    if isinstance(ev, Gap):
        err_console().print(f"[yellow]gap:[/] {markup_safe(ev.stream)}/{markup_safe(ev.instance)}: committed {ev.committed}, "
                            f"POSITION {ev.prev_token} -> {ev.new_token} ({ev.kind})", highlight=False)
    elif type(ev).__name__ == "Reconnecting":
        err_console().print(f"[yellow]reconnecting[/] in {ev.delay:.1f} s: {markup_safe(ev.reason)}", highlight=False)


def run_stream(opts: LiveOptions, ops: frozenset[str] | None = None, key: str | None = None) -> None:
    fmt = default_format(opts.fmt)
    view = live_view(fmt, opts, ops, key)
    # the live table: `ts` where it costs no line; without -v every row printed is `in`
    columns = ["ts", *(c for c in TABLE_COLUMNS if not (view.quiet and c == "direction"))]
    sink = stream_sink(opts, lambda: Sink(fmt, columns=columns if fmt != "jsonl" else None,
                                          live=True, optional=frozenset({"ts"})))
    handler = StreamHandler(opts, sink, tell)
    handler.view = view
    client = synapse_capture.make_client(opts)
    handler.client = client
    run_deadline(opts.duration)
    server = metrics.serve_synapse(opts, handler, client, say=lambda t: err_console().print(t, markup=False))
    with StopSignals() as signals:
        _, error = run_and_close(lambda: synapse_capture.run(opts, client, handler, signals,
                                                             on_attach=note_stop_signals), sink)
        metrics.stop(server)
        stop_exc = error if error is not None else signals.interrupted()
        if handler.streaming or stop_exc is not None and error is None or \
                handler.stats.stopped == MAX_MESSAGES:   # --max-messages before the data: still a summary
            summary = handler.stats.summary(stop_exc, default=END)
            summary.update(gaps=len(handler.gaps), server_errors=len(handler.server_errors))
            add_rates(summary)
            if not isinstance(error, BrokenPipeError):
                print_stream_summary(summary, opts)
    if stop_exc is not None:
        raise stop_exc


# ------------------------------------------------------------------------------ capture

def _progress_printer():
    from rich.live import Live
    from rich.text import Text
    con = err_console()
    live = Live(Text(""), console=con, redirect_stdout=False, redirect_stderr=False,
                transient=True, auto_refresh=False)
    state = {"t0": time.monotonic(), "last": (time.monotonic(), 0, 0)}

    def show(h: synapse_capture.CaptureHandler):
        now = time.monotonic()
        t, n, b = state["last"]
        dt = max(1e-6, now - t)
        lps = (h.frame_no - n) / dt
        mbs = (h.bytes - b) / dt / 1e6
        state["last"] = (now, h.frame_no, h.bytes)
        head = f"{h.frame_no:,} lines  {lps:,.0f} lines/s  {mbs:.1f} MB/s  gaps {len(h.gaps)}"
        if h.client is not None:   # the committed tokens that fit the line (80 columns too)
            items = sorted(h.client.committed().items())
            head += "  " + fit_items([f"{s}/{i}={t}" for (s, i), t in items], len(items),
                                     con.width - len(head) - 3)
        live.update(Text(head, no_wrap=True, overflow="ellipsis"), refresh=True)

    return live, show


def run_capture(opts: LiveOptions, settings: CaptureSettings) -> None:
    live = show = None
    if not settings.quiet:
        live, show = _progress_printer()
        live.start()
    # SIGINT (even when inherited ignored), SIGTERM, SIGHUP: the same clean finish as Ctrl-C
    with StopSignals() as signals:
        try:
            result = synapse_capture.capture_synapse(opts, settings, progress=show, tell=tell, signals=signals,
                                                     note=lambda text: err_console().print(text, highlight=False))
        finally:
            if live is not None:
                live.stop()
        if result.wrote:
            print_summary(result.files, json_summary=settings.json_summary, quiet=settings.quiet,
                          extra=result.summary())
            if result.gaps and not settings.quiet:
                err_console().print(f"[yellow]{result.gaps} gap(s) seen[/]", highlight=False)
    if result.error is not None:
        raise result.error
