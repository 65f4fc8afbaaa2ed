"""`dcptool inspect CAPTURE...`: what a capture holds, without replaying it. The summary
is computed by replay/check/summary.py (in bounded memory); this command renders it: tables for
people on a terminal (identical per-vbucket rows as one row of vbucket ranges), one JSON document
in a pipe or with `--json`, on stdout (the summary is the command's data).
"""

from __future__ import annotations

import json
import sys

import click

from dcptool.cli.sources import capture_paths
from dcptool.cli.view.console import data_console, stdout_is_tty

# Lazy imports: only where start-up time needs them (`inspect --help` loads no pyarrow: the
# summary and the output load when the command runs).

_LEFT = ("vbuckets", "file", "op", "command", "stream", "instance", "reason", "error", "capture_id", "started_at",
         "node", "from node", "via", "active", "ts")
_FOLD = ("file", "error")  # long text that may wrap on a terminal; ids, names, numbers stay whole


def render(summary: dict, console) -> None:
    """The summary as tables. Every cell is rich Text (never markup) escaped by
    output.printable: stream names, ops, errors and paths can come from the other side."""
    from rich.table import Table
    from rich.text import Text

    from dcptool.cli.view.output import printable
    from dcptool.replay.check.summary import collapsed, lag_text, vb_table

    class _Table(Table):
        def add_row(self, *cells, **kw):
            super().add_row(*[Text(printable(c)) for c in cells], **kw)

    def table(title, *cols):
        t = _Table(title=title, title_justify="left", title_style="bold")
        for c in cols:
            fold = c in _FOLD
            t.add_column(c, justify="left" if c in _LEFT else "right", no_wrap=not fold,
                         overflow="ellipsis" if fold else "fold")   # a word too long: cut with …, not split
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
        title, head, cells, line = vb_table(summary["vbuckets"])   # identical rows as vbucket ranges
        listed(title, head, cells)
        if line:
            console.print(line, highlight=False, markup=False)
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
    from dcptool.replay.check.summary import summarize
    paths = capture_paths(captures)
    summary = summarize(paths)
    if as_json or (fmt or ("json" if not stdout_is_tty() else "table")) == "json":
        sys.stdout.write(json.dumps(summary, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        return
    render(summary, data_console(sys.stdout, highlight=False))
