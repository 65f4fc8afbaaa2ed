"""The HTML parts of `dcptool report` that are not charts (replay/check/report.py draws those):
the title line, the summary strip at the top (how the capture went, in a few numbers, with the
verify verdict), the one-line stand-ins of empty charts, the Synapse table per stream and
instance, and the verify findings."""

from __future__ import annotations

import datetime as _dt
import html

from dcptool import __version__
from dcptool.replay.check import report_data as D
from dcptool.replay.check.findings import FINDING_COLUMNS

FINDINGS_TITLE = "Verify findings"
STRIP_TITLE = "Summary"
STREAMS_TITLE = "Streams per instance"
STYLE = """body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 4px}p.sum{margin:0 0 12px;color:#555}h2{font-size:16px;margin:16px 0 6px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}
th{background:#f0f0f0}.fig{margin:8px 0}.none{color:#070}
.strip{display:flex;flex-wrap:wrap;gap:8px;margin:0 0 12px}
.card{border:1px solid #ddd;border-radius:6px;padding:6px 12px;min-width:130px;background:#fafafa}
.card .v{font-size:20px;font-weight:600}.card .k{font-size:12px;color:#555}.card .n{font-size:11px;color:#777}
.card.good{border-color:#7b7;background:#f3fbf3}.card.warn{border-color:#e0a040;background:#fff8ec}
.card.bad{border-color:#d66;background:#fdf1f1}
p.empty{margin:4px 0;padding:4px 8px;border-left:3px solid #ccc;color:#555;font-size:13px}"""


def ranges(vbs: list[int]) -> str:
    """0-3,7: sorted ids as ranges."""
    out: list[str] = []
    for v in sorted(vbs):
        if out and "-" not in out[-1] and int(out[-1]) == v - 1:
            out[-1] = f"{out[-1]}-{v}"
        elif out and "-" in out[-1] and int(out[-1].split("-")[1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def _card(label: str, value: str, note: str = "", tone: str = "") -> str:
    return (f"<div class='card {tone}'><div class='k'>{html.escape(label)}</div><div class='v'>{html.escape(value)}"
            f"</div><div class='n'>{html.escape(note)}</div></div>")


def _verdict(report) -> str:
    if report is None:
        return _card("verify", "not run", "--no-verify")
    n = report.summary()["findings"]
    if not n:
        return _card("verify", "clean", "no findings", "good")
    return _card("verify", f"{n:,} finding(s)", "see Verify findings below", "bad")


def _lag_card(d: D.ReportData) -> str:
    if d.lag is None:
        return ""
    best = max(((int(v.max()), node) for node, (_, v) in d.lag.items() if len(v)), default=None)
    if best is None:
        return _card("largest lag", "none", "no poll answered for a vbucket with a position")
    return _card("largest lag", f"{best[0]:,} items", f"on {best[1]}", "warn" if best[0] else "good")


def _phases_card(d: D.ReportData) -> str:
    b = d.backfill
    if not b:
        return _card("backfill", "none", "every change came live")
    secs = (b["last_ns"] - b["first_ns"]) / D.NS
    live = sum(int(v.sum()) for v in d.ops.values())
    return _card("backfill", f"{b['items']:,} items", f"in {secs:,.1f} s; then {live:,} changes live")


def _dcp_cards(d: D.ReportData) -> list[str]:
    t, ops = d.tables, d.op_totals
    docs = t.get("documents", {})
    undone = t.get("undone", 0)
    rollbacks = t.get("rollbacks", d.mark_counts.get("rollback", 0))
    return [
        _card("documents", f"{docs.get('live', 0):,}",
              f"{docs.get('deleted', 0):,} deleted, {docs.get('expired', 0):,} expired"),
        _card("mutations / deletions / expirations",
              f"{ops.get('mutation', 0):,} / {ops.get('deletion', 0):,} / {ops.get('expiration', 0):,}",
              f"{ops.get('commit', 0):,} commits" if ops.get("commit") else "received"),
        _card("rollbacks", f"{rollbacks:,}", f"{undone:,} documents undone", "warn" if rollbacks else ""),
        _card("unserved vbuckets", f"{len(d.unserved):,}", ranges(d.unserved) if d.unserved else "every vbucket served",
              "bad" if d.unserved else ""),
        _phases_card(d), _lag_card(d)]


def _synapse_cards(d: D.ReportData) -> list[str]:
    t = d.tables
    pos = t.get("positions", [])
    gaps, skipped = t.get("gaps", 0), t.get("gap_tokens", 0)
    return [
        _card("RDATA rows", f"{d.op_totals.get('RDATA', 0):,}", f"{d.op_totals.get('POSITION', 0):,} POSITION lines"),
        _card("streams x instances", f"{len(pos):,}",
              f"{len({r['stream'] for r in pos})} stream(s), {len({r['instance'] for r in pos})} instance(s)"),
        _card("caught up", f"{d.caught_up:,} rows", "fetched from the writers (--catch-up)"),
        _card("gaps", f"{gaps:,}", f"{skipped:,} tokens skipped" if gaps else "none left", "bad" if gaps else "good")]


def strip(d: D.ReportData, report) -> str:
    """The summary strip: the verify verdict first, then the protocol's numbers."""
    cards = [_verdict(report)] + (_dcp_cards(d) if d.protocol == "dcp" else _synapse_cards(d))
    return f"<div class='strip' title='{STRIP_TITLE}'>{''.join(c for c in cards if c)}</div>"


def title(d: D.ReportData, paths: list[str]) -> str:
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


def empty(title_text: str, why: str) -> str:
    """A chart with nothing to draw, as one line."""
    return f"<p class='empty'><b>{html.escape(title_text)}</b>: {html.escape(why)}</p>"


def streams_table(d: D.ReportData) -> str:
    """Synapse: one row per stream and instance (the `positions` table)."""
    pos = d.tables.get("positions") or []
    if not pos:
        return empty(STREAMS_TITLE, "none")
    cols = ["stream", "instance", "token", "rows", "gaps", "dropped"]
    cols = [c for c in cols if c in pos[0]]
    rows = ["<tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"]
    for r in pos:
        rows.append("<tr>" + "".join(f"<td>{html.escape('' if r[c] is None else f'{r[c]:,}' if isinstance(r[c], int) else str(r[c]))}</td>"
                                     for c in cols) + "</tr>")
    return f"<h2>{STREAMS_TITLE}</h2><table>{''.join(rows)}</table>"


def findings(report) -> str:
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
