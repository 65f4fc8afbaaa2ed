"""`dcptool report`: one self-contained HTML page about captures. The numbers come from
replay/check/report_data.py (`ts` for the span, then one pass); this module draws them with plotly,
whose JavaScript is inlined once at the top of the page (every later figure uses it), so the
page opens from a file with nothing fetched from the network. Time series have at
most `max_points` equal time bins (report_data.py); the verify findings (replay/check/verify.py) are an HTML table."""

from __future__ import annotations

import datetime as _dt
import html
import os

import numpy as np

from dcptool import __version__
from dcptool.replay.check import report_data as D
from dcptool.replay.check import verify as V
from dcptool.replay.check.findings import FINDING_COLUMNS
from dcptool.replay.check.summary import retained_window
from dcptool.replay.store import reader

TITLES = {
    "rate": "Frames and bytes per second",
    "progress_dcp": "Progress per vbucket (highest seqno)",
    "progress_synapse": "Progress per stream (highest token)",
    "lag": "Lag per node (items behind the high seqno, highest of its vbuckets)",
    "marks": "Rollbacks, failovers, rebalances and reconnects",
    "kinds_dcp": "Snapshot kinds",
    "kinds_synapse": "RDATA rows per stream",
    "segments": "Segment sizes",
    "keys": "Keys with the most changes",
}
FINDINGS_TITLE = "Verify findings"
STYLE = """body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 4px}p.sum{margin:0 0 12px;color:#555}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}
th{background:#f0f0f0}.fig{margin:8px 0}.none{color:#070}"""


def _times(ns) -> np.ndarray:
    return np.asarray(ns, np.int64).astype("datetime64[ns]")


def _width_text(ns: int) -> str:
    return f"{ns / D.NS:g} s" if ns >= D.NS else f"{ns / 1e6:g} ms"


def _layout(fig, title: str, height: int = 360) -> None:
    fig.update_layout(title={"text": title}, height=height, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                      template="plotly_white", legend={"font": {"size": 10}})


def _rate(go, sub, d: D.ReportData):
    per_s = D.NS / d.width_ns
    x = _times(d.bins)
    fig = sub(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    fig.add_trace(go.Scatter(x=x, y=d.frames_per_bin * per_s, name="frames/s", mode="lines"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=d.bytes_per_bin * per_s, name="bytes/s", mode="lines"), row=2, col=1)
    fig.update_yaxes(title_text="frames/s", row=1, col=1)
    fig.update_yaxes(title_text="bytes/s", row=2, col=1)
    _layout(fig, TITLES["rate"] + f" ({_width_text(d.width_ns)} bins)", 420)
    return fig


def _progress(go, d: D.ReportData):
    fig = go.Figure()
    for name, (x, v) in d.progress.items():
        fig.add_trace(go.Scatter(x=_times(x), y=v, name=name, mode="lines+markers", marker={"size": 3}))
    title = TITLES["progress_" + d.protocol]
    if d.progress_series > len(d.progress):
        title += f" ({len(d.progress)} busiest of {d.progress_series})"
    _layout(fig, title, 420)
    return fig


def _marks(go, d: D.ReportData):
    fig = go.Figure()
    for kind in sorted(d.marks):
        pts = d.marks[kind]
        n = d.mark_counts[kind]
        text = [t if c == 1 else f"{t} (+{c - 1:,} more in this bin)" for _, t, c in pts]
        fig.add_trace(go.Scatter(x=np.array([p[0] for p in pts], np.int64).astype("datetime64[ns]"),
                                 y=[kind] * len(pts), text=text, mode="markers",
                                 marker={"symbol": "line-ns-open", "size": 18}, name=f"{kind} ({n:,})",
                                 hovertemplate="%{x}<br>%{text}<extra></extra>"))
    if d.frames:
        fig.update_xaxes(range=list(_times([d.t0_ns, d.t1_ns + d.width_ns])))
    title = TITLES["marks"] + ("" if d.marks else ": none")
    _layout(fig, title, 260)
    return fig


def _bar(go, title: str, labels: list, values: list, horizontal: bool = False, hover=None):
    fig = go.Figure()
    if horizontal:
        fig.add_trace(go.Bar(x=values[::-1], y=labels[::-1], orientation="h", hovertext=hover))
    else:
        fig.add_trace(go.Bar(x=labels, y=values, hovertext=hover))
    _layout(fig, title + ("" if labels else ": none"), max(260, 22 * len(labels) + 90) if horizontal else 320)
    return fig


def _findings_html(report) -> str:
    if report is None:
        return f"<h2>{FINDINGS_TITLE}</h2><p>not run (--no-verify)</p>"
    s = report.summary()
    head = (f"<h2>{FINDINGS_TITLE}</h2><p>{s['findings']:,} finding(s) in {s['rows']:,} rows: "
            + ", ".join(f"{html.escape(k)} {v:,}" for k, v in s["by_check"].items()) + "</p>")
    if not report.findings:
        return head.replace("<p>0 finding(s)", "<p class='none'>no findings:")
    cols = [c for c in FINDING_COLUMNS if c not in ("file",)]
    rows = ["<tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"]
    for f in report.findings:
        r = f.to_row()
        rows.append("<tr>" + "".join(f"<td>{html.escape('' if r[c] is None else str(r[c]))}</td>"
                                     for c in cols) + "</tr>")
    more = "" if s["shown"] == s["findings"] else f"<p>{s['shown']:,} of {s['findings']:,} shown</p>"
    return head + "<table>" + "".join(rows) + "</table>" + more


def _summary_html(d: D.ReportData, paths: list[str]) -> str:
    span = ""
    if d.frames:
        t0 = _dt.datetime.fromtimestamp(d.t0_ns / D.NS, _dt.timezone.utc)
        span = f", {t0:%Y-%m-%d %H:%M:%S} UTC + {(d.t1_ns - d.t0_ns) / D.NS:,.3f} s"
    ring = ""
    if d.retained:       # the capture is a retention ring's window (replay's note)
        r = d.retained
        ring = (f"<p class='ring'>retained window: {html.escape(r['note'])} "
                f"({html.escape(', '.join(r['records']))}; {r['bytes_dropped']:,} bytes dropped)</p>")
    caught = (f"; {d.caught_up:,} rows caught up from the writers (capture --catch-up)"
              if d.protocol == "synapse" and d.caught_up else "")
    return (f"<h1>dcptool report: {html.escape(', '.join(paths))}</h1><p class='sum'>{d.protocol}, "
            f"{len(d.segments)} segment(s), {d.frames:,} frames, {d.bytes:,} bytes{span}{caught}; "
            f"dcptool {html.escape(__version__)}</p>{ring}")


def _lag(go, d: D.ReportData):
    fig = go.Figure()
    for node, (x, v) in (d.lag or {}).items():
        fig.add_trace(go.Scatter(x=_times(x), y=v, name=node, mode="lines+markers", marker={"size": 3}))
    _layout(fig, TITLES["lag"] + ("" if d.lag else ": none"), 360)
    return fig


def figures(d: D.ReportData) -> list:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    segs = d.segments
    figs = [_rate(go, make_subplots, d), _progress(go, d), _marks(go, d),
            _bar(go, TITLES["kinds_" + d.protocol], list(d.kinds), list(d.kinds.values())),
            _bar(go, TITLES["segments"] + " (MiB)", [s.name for s in segs], [s.bytes / 2**20 for s in segs],
                 hover=[f"{s.bytes:,} bytes, {'?' if s.rows is None else f'{s.rows:,}'} rows" for s in segs])]
    if d.lag is not None:      # a replay with a `lag` table (issue 26)
        figs.insert(2, _lag(go, d))
    if d.protocol == "dcp":
        figs.append(_bar(go, TITLES["keys"], [f"{k} (collection {c})" if c else k for k, c, _ in d.top_keys],
                         [n for _, _, n in d.top_keys], horizontal=True))
    return figs


def page(d: D.ReportData, report, paths: list[str]) -> str:
    """The whole HTML page."""
    parts = []
    config = {"displaylogo": False, "responsive": True}
    for i, fig in enumerate(figures(d)):
        parts.append("<div class='fig'>" + fig.to_html(full_html=False, include_plotlyjs=(i == 0),
                                                       config=config) + "</div>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>dcptool report</title>"
            f"<style>{STYLE}</style></head><body>{_summary_html(d, paths)}{''.join(parts)}"
            f"{_findings_html(report)}</body></html>")


def report(paths: list[str], output: str, *, files: list | None = None, max_points: int = 2000, top_keys: int = 20,
           max_series: int = 32, verify: bool = True, findings_limit: int = 200) -> D.ReportData:
    """Write the report of the captures `paths` (files or directories) to `output`."""
    files = reader.find_captures(paths) if files is None else files
    d = D.collect(files, max_points=max_points, max_series=max_series, top_keys=top_keys)
    d.retained = retained_window(paths)
    findings = V.verify(paths, limit=findings_limit) if verify else None
    text = page(d, findings, paths)
    tmp = output + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return d
