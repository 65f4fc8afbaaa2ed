"""`dcptool diff CAPTURE_A CAPTURE_B` / `dcptool diff CAPTURE --at T1 --at T2`: the documents
added, changed and removed between two `documents` tables (replay/check/diff.py). Exit 0 when
they are equal, 6 when they differ (the "findings" code), 1 when a capture is unreadable."""

from __future__ import annotations

import click

from dcptool.cli import exit_codes
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import Sink, default_format
from dcptool.replay.display import dcp_display, with_key_base64

# Lazy imports: only where start-up time needs them (`diff --help` loads no numpy or pyarrow:
# the engine, the reader and the diff itself load when the command runs).


def _files(path: str):
    from dcptool.replay.store import reader
    files = reader.find_captures([path])
    if not files:
        raise reader.CaptureError(f"{path}: no capture files found (no dcptool .parquet or .arrows segment)")
    if reader.protocol_of(files) != "dcp":
        raise click.UsageError(f"{path}: diff compares DCP captures (documents); this one is "
                               f"{reader.protocol_of(files)}")
    return files


def _documents(files, at_ns: int | None):
    from dcptool.replay.local import engine as local
    from dcptool.replay.rules.as_of import AsOf
    return local.replay_local(files, tables=["documents"], as_of=None if at_ns is None else AsOf(at_ns)).table("documents")


@click.command("diff")
@click.argument("captures", nargs=-1, required=True)
@click.option("--at", "at", multiple=True, metavar="MOMENT",
              help="Compare the capture with itself at two moments, given twice: start, end, +DURATION "
                   "(after its start), -DURATION (before its end), RFC 3339 or integer nanoseconds.")
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl"]), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
@click.pass_context
def diff(ctx, captures, at, fmt):
    """Documents added, changed and removed between two DCP captures, or between two moments
    of one capture.

    \b
    One row per document that differs: change (added, changed, removed), vbucket,
    collection_id, key, and before_/after_ by_seqno, cas, state. Exit 0 when equal,
    6 when different, 1 when a capture is unreadable.

    \b
    Examples:
      dcptool diff captures/monday/ captures/tuesday/
      dcptool diff captures/ --at 2026-01-02T03:00:00Z --at 2026-01-02T04:00:00Z
      dcptool diff captures/ --at +30s --at end
      dcptool diff a/ b/ --format jsonl | jq -c 'select(.change=="removed") | .key'
    """
    from dcptool.replay.check import diff as D
    if at:
        if len(captures) != 1 or len(at) != 2:
            raise click.UsageError("--at compares one capture at two moments: one CAPTURE and --at twice")
        if problem := next(filter(None, map(D.moment_problem, at)), None):
            raise click.UsageError(f"--at: {problem}")
        files = _files(captures[0])
        span = D.capture_span(files)
        pairs = [(files, D.resolve_moment(text, span, captures[0])) for text in at]
    else:
        if len(captures) != 2:
            raise click.UsageError("give two captures (CAPTURE_A CAPTURE_B), or one capture and --at twice")
        pairs = [(_files(captures[0]), None), (_files(captures[1]), None)]

    console = err_console()
    with console.status("replaying", spinner="dots"):
        before = _documents(*pairs[0])
        after = _documents(*pairs[1])
    result = D.diff_documents(before, after)
    _print(result, fmt)
    console.print(D.summary_line(result, before.num_rows, after.num_rows), highlight=False)
    ctx.exit(exit_codes.EXIT_FINDINGS if result.num_rows else exit_codes.EXIT_OK)


def _print(result, fmt):
    fmt = default_format(fmt)
    columns = with_key_base64(result.column_names)
    sink = Sink(fmt, columns=columns, title=f"diff ({result.num_rows} documents)")
    for batch in result.to_batches(max_chunksize=4096):
        sink.write_many(dcp_display(r) for r in batch.to_pylist())
    sink.close()
