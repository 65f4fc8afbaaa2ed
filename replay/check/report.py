"""`dcptool report`: one self-contained HTML page about captures. The numbers come from
replay/check/report_data.py (`ts` for the span, then one pass); this module draws them with plotly,
whose JavaScript is inlined once at the top of the page (every later figure uses it), so the
page opens from a file with nothing fetched from the network. Time series have at
most `max_points` equal time bins (report_data.py); the verify findings (replay/check/verify.py) are an HTML table."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dcptool.replay.check import report_data as D
from dcptool.replay.check import report_html as H
from dcptool.replay.check import verify as V
from dcptool.replay.check.summary import retained_window
from dcptool.replay.store import reader

TITLES = {
    "rate": "Frames and bytes per second",
    "ops_dcp": "Changes per second by operation",
    "ops_synapse": "Lines per second by command",
    "backfill": "Backfill (items per second inside disk snapshots)",
    "progress_dcp": "Progress per vbucket (highest seqno)",
    "progress_synapse": "Progress per stream and instance (highest token)",
    "lag": "Lag per node (items behind the high seqno, highest of its vbuckets)",
    "marks": "Rollbacks, failovers, rebalances and reconnects",
    "kinds_dcp": "Snapshot kinds",
    "kinds_synapse": "RDATA rows per stream and instance",
    "segments": "Segment sizes",
    "keys": "Keys with the most changes",
}
FINDINGS_TITLE = H.FINDINGS_TITLE


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
    fig.update_yaxes(title_text="frames/s", type="log", row=1, col=1)
    fig.update_yaxes(title_text="bytes/s", type="log", row=2, col=1)
    _shade_backfill(fig, d)
    _layout(fig, TITLES["rate"] + f" ({_width_text(d.width_ns)} bins, log scale)", 420)
    return fig


def _shade_backfill(fig, d: D.ReportData) -> None:
    b = d.backfill
    if b:
        x0, x1 = _times([b["first_ns"], b["last_ns"] + d.width_ns])
        fig.add_vrect(x0=x0, x1=x1, fillcolor="#888", opacity=0.12, line_width=0, annotation_text="backfill",
                      annotation_position="top left")


def _ops(go, d: D.ReportData):
    """Per op (DCP: the changes after the backfill, which has its own chart) per second."""
    per_s = D.NS / d.width_ns
    x = _times(d.bins)
    fig = go.Figure()
    for name in sorted(d.ops, key=lambda n: -int(d.ops[n].sum())):
        have = d.ops[name] > 0          # a log axis: the empty bins are left out, not drawn at 0
        if have.any():
            fig.add_trace(go.Scatter(x=x[have], y=d.ops[name][have] * per_s, name=f"{name} ({int(d.ops[name].sum()):,})",
                                     mode="lines+markers", marker={"size": 3}, line={"width": 1}))
    if d.frames:
        fig.update_xaxes(range=list(_times([d.t0_ns, d.t1_ns + d.width_ns])))
    fig.update_yaxes(type="log", title_text="per second")
    title = TITLES["ops_" + d.protocol] + (" (live: the backfill apart" if d.backfill else " (") + "; log scale)"
    _layout(fig, title, 320)
    return fig if fig.data else None


def _backfill(go, d: D.ReportData):
    b = d.backfill
    if not b:
        return None
    per_s = D.NS / d.width_ns
    have = b["per_bin"] > 0
    fig = go.Figure(go.Bar(x=_times(d.bins[have]), y=b["per_bin"][have] * per_s, name="backfill items/s",
                           width=d.width_ns / 1e6, offset=0))    # a date axis counts widths in ms
    secs = (b["last_ns"] - b["first_ns"]) / D.NS
    _layout(fig, TITLES["backfill"] + f": {b['items']:,} items in {secs:,.2f} s", 280)
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
    if not d.marks:
        return None
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
    _layout(fig, TITLES["marks"], 260)
    return fig


def _bar(go, title: str, labels: list, values: list, horizontal: bool = False, hover=None):
    if not labels:
        return None
    fig = go.Figure()
    if horizontal:
        fig.add_trace(go.Bar(x=values[::-1], y=labels[::-1], orientation="h", hovertext=hover))
    else:
        fig.add_trace(go.Bar(x=labels, y=values, hovertext=hover))
    _layout(fig, title, max(260, 22 * len(labels) + 90) if horizontal else 320)
    return fig


def _lag(go, d: D.ReportData):
    """None when no poll found any vbucket behind (the page says so in one line)."""
    if not d.lag or not any(len(v) and v.max() > 0 for _, v in d.lag.values()):
        return None
    fig = go.Figure()
    for node, (x, v) in d.lag.items():
        fig.add_trace(go.Scatter(x=_times(x), y=v, name=node, mode="lines+markers", marker={"size": 3}))
    _layout(fig, TITLES["lag"], 360)
    return fig


def _lag_empty(d: D.ReportData) -> str:
    return "none recorded (no lag poll answered for a vbucket with a position)" if not d.lag else \
        "0 items at every poll: never behind"


def sections(d: D.ReportData) -> list[tuple[str, Any, str]]:
    """(title, figure or None, what the one line says when None), in page order."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    segs = d.segments
    proto = d.protocol
    out = [(TITLES["rate"], _rate(go, make_subplots, d), "no frames"),
           (TITLES["ops_" + proto], _ops(go, d), "none received")]
    if proto == "dcp":
        out.append((TITLES["backfill"], _backfill(go, d), "none: every change came in memory snapshots"))
    out.append((TITLES["progress_" + proto], _progress(go, d), "none"))
    if d.lag is not None:      # a replay with a `lag` table (issue 26)
        out.append((TITLES["lag"], _lag(go, d), _lag_empty(d)))
    out += [(TITLES["marks"], _marks(go, d), "none"),
            (TITLES["kinds_" + proto], _bar(go, TITLES["kinds_" + proto], list(d.kinds), list(d.kinds.values())),
             "none"),
            (TITLES["segments"], _bar(go, TITLES["segments"] + " (MiB)", [s.name for s in segs],
                                      [s.bytes / 2**20 for s in segs],
                                      hover=[f"{s.bytes:,} bytes, {'?' if s.rows is None else f'{s.rows:,}'} rows"
                                             for s in segs]), "none")]
    if proto == "dcp":
        out.append((TITLES["keys"], _bar(go, TITLES["keys"], [f"{k} (collection {c})" if c else k
                                                               for k, c, _ in d.top_keys],
                                         [n for _, _, n in d.top_keys], horizontal=True), "none"))
    return out


def figures(d: D.ReportData) -> list:
    """The charts drawn (the empty ones are a line of text instead)."""
    return [fig for _, fig, _ in sections(d) if fig is not None]


def page(d: D.ReportData, report, paths: list[str]) -> str:
    """The whole HTML page: title, summary strip, charts (an empty one as one line), the
    Synapse streams table, the verify findings."""
    parts = []
    config = {"displaylogo": False, "responsive": True}
    first = True
    for title, fig, why in sections(d):
        if fig is None:
            parts.append(H.empty(title, why))
            continue
        parts.append("<div class='fig'>" + fig.to_html(full_html=False, include_plotlyjs=first,
                                                       config=config) + "</div>")
        first = False
    if d.protocol == "synapse":
        parts.append(H.streams_table(d))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>dcptool report</title>"
            f"<style>{H.STYLE}</style></head><body>{H.title(d, paths)}{H.strip(d, report)}{''.join(parts)}"
            f"{H.findings(report)}</body></html>")


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
