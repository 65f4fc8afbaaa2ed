"""`dcptool inspect CAPTURE...`: what a capture holds, without replaying it. The summary
is computed by replay/check/summary.py (in bounded memory); this command renders it: tables for
people on a terminal (identical per-vbucket rows as one row of vbucket ranges), one JSON document
in a pipe or with `--json`, on stdout (the summary is the command's data).
"""

from __future__ import annotations

import json
import sys

import click

from dcptool.cli.view.console import data_console, stdout_is_tty

_LEFT = ("vbuckets", "file", "op", "command", "stream", "instance", "reason", "error", "capture_id", "started_at",
         "node", "from node", "via", "active", "ts")
_FOLD = ("file", "error")  # long text that may wrap on a terminal; ids, names, numbers stay whole


def render(summary: dict, console) -> None:
    """The summary as tables. Every cell is rich Text (never markup) escaped by
    output.printable: stream names, ops, errors and paths can come from the other side."""
    from rich.table import Table
    from rich.text import Text

    from dcptool.cli.view.output import printable
    from dcptool.replay.check.summary import lag_text

    class _Table(Table):
        def add_row(self, *cells, **kw):
            super().add_row(*[Text(printable(c)) for c in cells], **kw)

    def table(title, *cols):
        t = _Table(title=title, title_justify="left", title_style="bold")
        for c in cols:
            fold = c in _FOLD
            t.add_column(c, justify="left" if c in _LEFT else "right", no_wrap=not fold,
                         overflow="fold")
        return t

    def listed(title, cols, rows, none=None):
        """A table of `rows` (lists of cells), or `NONE: none` when there are none."""
        if not rows:
            console.print(f"{none or title}: none", highlight=False)
            return
        t = table(title, *cols)
        for r in rows:
            t.add_row(*r)
        console.print(t)

    listed("files", ("file", "capture_id", "segment", "rows"), [(f["path"] + (" (in progress)" if f["in_progress"] else ""),
           f["capture_id"][:8], str(f["segment"]), f"{f['rows']:,}") for f in summary["files"]])
    if r := summary.get("retained"):        # a retention ring dropped the oldest segments
        console.print(f"retained window: {r['note']} ({', '.join(r['records'])})", highlight=False, markup=False)
    span = summary["time_span"]
    console.print(f"protocol {summary['protocol']}, {len(summary['captures'])} capture(s), "
                  f"{summary['rows']:,} rows"
                  + (f", {span['first']} .. {span['last']} ({span['seconds']:.3f} s)" if span else "")
                  + "; " + ", ".join(f"{printable(k)}: {v:,}" for k, v in summary["directions"].items()),
                  highlight=False, markup=False)
    if summary.get("nodes"):
        nodes = table("nodes", "node", "rows")
        for k, v in summary["nodes"].items():
            nodes.add_row(str(k), f"{v:,}")
        console.print(nodes)
    kind = "op" if summary["protocol"] == "dcp" else "command"
    kinds = table(f"rows per {kind}", kind, "rows")
    for k, v in summary["ops" if kind == "op" else "commands"].items():
        kinds.add_row(str(k), f"{v:,}")
    console.print(kinds)
    if summary["protocol"] == "dcp":
        _vbuckets(summary["vbuckets"], listed, table, console)
        console.print(f"snapshots: {summary['snapshots']:,}", highlight=False)
        listed("rollbacks", ("vbuckets", "rollback seqno", "frame_no"),
               collapsed(((r["vbucket"], (str(r["rollback_seqno"]),), r["frame_no"]) for r in summary["rollbacks"])))
        listed("stream ends", ("vbuckets", "reason", "frame_no"),
               collapsed(((r["vbucket"], (f"{r['reason']} ({r['reason_name']})",), r["frame_no"])
                          for r in summary["stream_ends"])))
        listed("cluster config revisions", ("rev", "ts", "from node", "via", "vbuckets", "active"),
               [(f"{c['rev_epoch']}:{c['rev']}", c["ts"] or "", c["node"] or "", c["via"], str(c["vbuckets"]),
                 ", ".join(f"{k} {v}" for k, v in c["active"].items())) for c in summary.get("configs") or ()])
        console.print(lag_text(summary.get("largest_lag")), highlight=False)
    else:
        pos = table("positions", "stream", "instance", "token", "rows", "batches", "positions",
                    "gaps", "dropped", "waiting")
        for p in summary["positions"]:
            pos.add_row(*[("" if p[k] is None else str(p[k])) for k in
                          ("stream", "instance", "token", "rows", "batches", "positions", "gaps",
                           "dropped", "waiting")])
        console.print(pos)
        listed("gaps", ("stream", "instance", "from token", "to token", "frame_no"),
               [(str(g["stream"]), str(g["instance"]), str(g["from_token"]), str(g["to_token"]), str(g["frame_no"]))
                for g in summary["gaps"]])
    de = summary["decode_errors"]
    listed(f"decode errors ({de['count']:,})", ("capture_id", "frame_no", "error"),
           [(e["capture_id"][:8], str(e["frame_no"]), e["error"]) for e in de["examples"]] if de["count"] else [],
           "decode errors")


_VB_KEYS = ("items", "first_seqno", "last_seqno", "min_seqno", "max_seqno", "snapshots", "rollbacks",
            "stream_end_reason")
_VB_HEAD = ("items", "first seqno", "last seqno", "min", "max", "snapshots", "rollbacks", "stream end")
MAX_VB_ROWS = 32   # more (after collapsing) and the vbuckets table is a min / max / total summary


def vb_ranges(vbs, limit: int | None = None) -> str:
    """Vbucket numbers as ranges: [0, 1, 2, 3, 7, 9, 10] -> `0-3,7,9-10`; past `limit` ranges the
    first ones, then `… (N vbuckets)`."""
    out: list[str] = []
    ordered = sorted(set(vbs))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    if limit is not None and len(out) > limit:
        return ",".join(out[:limit]) + f",… ({len(ordered):,} vbuckets)"
    return ",".join(out)


def collapsed(rows) -> list[tuple[str, ...]]:
    """(vbucket, cells, frame_no) rows with identical cells as one row per cells: the vbuckets as
    ranges, the frame_no alone or as `first..last` (in order of first appearance)."""
    groups: dict[tuple, tuple[list[int], list[int]]] = {}
    for vb, cells, frame_no in rows:
        vbs, frames = groups.setdefault(tuple(cells), ([], []))
        vbs.append(vb)
        frames.append(frame_no)
    out = []
    for cells, (vbs, frames) in groups.items():
        known = [f for f in frames if f is not None]
        span = "" if not known else str(known[0]) if min(known) == max(known) else f"{min(known)}..{max(known)}"
        out.append((vb_ranges(vbs, limit=8), *cells, span))
    return out


def _vbuckets(rows: list[dict], listed, table, console) -> None:
    """Per-vbucket rows, a run of consecutive vbuckets with identical rows (but the vbucket) as
    one row `FIRST-LAST`; past MAX_VB_ROWS rows a min / max / total summary (`--json` keeps
    every vbucket's row)."""
    runs: list[tuple[list[int], tuple]] = []
    for v in sorted(rows, key=lambda r: r["vbucket"]):
        cells = tuple("" if v[k] is None else str(v[k]) for k in _VB_KEYS)
        if runs and runs[-1][1] == cells and runs[-1][0][-1] + 1 == v["vbucket"]:
            runs[-1][0].append(v["vbucket"])
        else:
            runs.append(([v["vbucket"]], cells))
    if len(runs) <= MAX_VB_ROWS:
        listed("vbuckets", ("vbuckets", *_VB_HEAD), [(vb_ranges(vbs), *cells) for vbs, cells in runs])
        return
    t = table(f"vbuckets ({len(rows):,}: {vb_ranges(v['vbucket'] for v in rows)}; every row with --json)",
              "", *_VB_HEAD[:-1])
    for name, fn in (("min", min), ("max", max), ("total", sum)):
        cells = []
        for k in _VB_KEYS[:-1]:
            vals = [v[k] for v in rows if v[k] is not None]
            cells.append("" if not vals or (name == "total" and "seqno" in k) else f"{fn(vals):,}")
        t.add_row(name, *cells)
    console.print(t)
    ends: dict[str, list[int]] = {}
    for v in rows:
        ends.setdefault("open" if v["stream_end_reason"] is None else str(v["stream_end_reason"]),
                        []).append(v["vbucket"])
    console.print("stream end per vbucket: " + "; ".join(f"{k}: {len(vbs):,} ({vb_ranges(vbs, limit=4)})"
                                                         for k, vbs in ends.items()),
                  highlight=False, markup=False)


@click.command("inspect")
@click.argument("captures", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default=None,
              help="Tables on a terminal, one JSON document in a pipe (default).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout (--format json).")
def inspect_cmd(captures, fmt, as_json):
    """Summarise captures: files, rows, time span, rows per op/command and per node, seqno
    ranges per vbucket, snapshots, rollbacks, stream ends, cluster config revisions, Synapse
    positions and gaps, decode errors, and the head a retention ring dropped (`retained`).

    CAPTURE is a segment (.parquet or in-progress .arrows), a directory, or - to read paths
    from stdin.

    \b
    Examples:
      dcptool inspect captures/
      dcptool inspect captures/ --json | jq '.vbuckets[] | select(.vbucket == 0)'
      dcptool inspect captures/ --format table | less
    """
    from dcptool.cli.sources import capture_paths
    from dcptool.replay.check.summary import summarize
    paths = capture_paths(captures)
    summary = summarize(paths)
    if as_json or (fmt or ("json" if not stdout_is_tty() else "table")) == "json":
        sys.stdout.write(json.dumps(summary, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return
    render(summary, data_console(sys.stdout, highlight=False))
