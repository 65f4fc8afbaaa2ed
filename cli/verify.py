"""`dcptool verify CAPTURE...`: continuity and protocol checks over captures (replay/check/verify.py).
Findings go to stdout (JSON lines in a pipe, a table on a terminal), the summary to stderr.
Exit 0 when clean, 6 when there are findings, 1 when nothing could be read."""

from __future__ import annotations

import json

import click

from dcptool.cli import exit_codes
from dcptool.cli.sources import capture_paths
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import Sink, default_format, printable
from dcptool.replay.check.findings import FINDING_COLUMNS

# Lazy imports: only where start-up time needs them (`verify --help` loads no pyarrow: the
# checks and the reader load when the command runs).


@click.command("verify")
@click.argument("captures", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl", "text"]), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Findings printed per check (all are counted in the summary).")
@click.option("--summary-json", "summary_json", type=click.Path(dir_okay=False, writable=True),
              default=None, metavar="FILE", help="Also write the summary as one JSON document to FILE.")
@click.option("--explain", is_flag=True,
              help="DCP: after the findings, one row per rollback: when, the vbucket, the failover "
                   "entries involved, the seqno range undone and the documents it undid.")
@click.pass_context
def verify(ctx, captures, fmt, limit, summary_json, explain):
    """Check captures for continuity and protocol correctness.

    \b
    Files: every segment readable (a damaged one is verified as far as it can be read, and the
    damage is the first finding), the segment chain 0..n complete, names, capture ids and
    metadata consistent, frame_no without holes, no unfinished (.arrows) segment.
    DCP, per vbucket and stream: seqnos increase, items inside their snapshot marker, markers
    do not overlap, a resumed stream starts at the last seqno received, rollbacks agree with
    the failover log, stream ends carry a known reason, OSO snapshots end.
    Synapse, per stream and instance: the batch token rule, tokens never go back, POSITION
    continuity (gaps), also across reconnects.

    \b
    One finding per line: check, severity, message, file, segment, capture_id, frame_no,
    vbucket, stream_id, stream, instance, seqno, token. Exit 0 when clean (or info only), 6 when
    there are errors or warnings, 1 when nothing could be read.

    \b
    Examples:
      dcptool verify captures/
      dcptool verify captures/ --format jsonl | jq -c 'select(.severity=="error")'
      dcptool verify monday/ tuesday/ --summary-json verify.json
      dcptool verify captures/ --explain --format jsonl | jq -c 'select(.rollback_seqno)'
    """
    from dcptool.replay.check import verify as V
    paths = capture_paths(captures)
    console = err_console()
    try:
        with console.status("verifying", spinner="dots"):
            report = V.verify(paths, limit=limit)
    except V.MixedProtocols as exc:
        raise click.UsageError(str(exc)) from None
    sink = Sink(default_format(fmt), columns=FINDING_COLUMNS, title="findings")
    rows = (f.to_row() for f in report.findings)
    sink.write_many(rows)
    sink.close()
    if explain and report.readable:
        _explain(paths, fmt)
    summary = report.summary()
    _print_summary(console, summary, printable)
    if summary_json:
        with open(summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, separators=(",", ":"))
            fh.write("\n")
    if not report.readable:
        exit_codes.error_line(f"nothing could be read: {report.unreadable_files} unreadable file(s)")
        ctx.exit(exit_codes.EXIT_RUNTIME)
    ctx.exit(exit_codes.EXIT_FINDINGS if summary["findings"] > summary["by_severity"]["info"] else exit_codes.EXIT_OK)


def _print_summary(console, s: dict, printable) -> None:
    sev = s["by_severity"]
    head = (f"verified {s['rows']:,} rows in {s['files']} file(s), {s['captures']} capture(s) "
            f"({s['protocol'] or 'unknown protocol'}) in {s['seconds']:.2f} s: ")
    if not s["findings"]:
        console.print(head + "no findings", highlight=False, markup=False)
        return
    shown = "" if s["shown"] == s["findings"] else f", {s['shown']:,} shown"
    console.print(head + f"{s['findings']:,} finding(s): {sev['error']:,} error, {sev['warn']:,} warn, "
                  f"{sev['info']:,} info{shown}", highlight=False, markup=False)
    for check, n in s["by_check"].items():
        console.print(f"  {printable(check)}: {n:,}", highlight=False, markup=False)


def _explain(paths, fmt) -> None:
    """The rollback forensics of replay/check/forensics.py, one row per rollback (a second kind of
    row after the findings: its keys are those of explain_rollbacks)."""
    from dcptool.replay.check.forensics import explain_rollbacks
    from dcptool.replay.store import reader
    rows = explain_rollbacks(reader.find_captures(paths))
    if rows:
        sink = Sink(default_format(fmt), columns=list(rows[0]), title="rollbacks")
        sink.write_many(rows)
        sink.close()
