"""`dcptool report CAPTURE... -o FILE.html` (registered in cli/__init__.py; it lives in cli/view/ because cli/ holds
at most 20 modules, tests/test_architecture.py): one self-contained HTML page of charts about
captures (replay/check/report.py). Exit 0 when written; the verify findings are shown in the
page, not turned into exit 6."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("captures", nargs=-1, required=True, metavar="CAPTURE...")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, writable=True),
              metavar="FILE.html", help="The page to write (replaced whole when done).")
@click.option("--max-points", type=click.IntRange(10, 100_000), default=2000, show_default=True,
              help="Points per time series at most: the span is cut into at most N equal bins (1 ms at least).")
@click.option("--top-keys", type=click.IntRange(0, 1000), default=20, show_default=True,
              help="Keys shown in 'Keys with the most changes' (DCP).")
@click.option("--max-series", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Vbuckets (DCP) or streams and instances (Synapse) drawn in the progress chart: the busiest.")
@click.option("--findings-limit", type=click.IntRange(1, 100_000), default=200, show_default=True,
              help="Verify findings listed per check (all are counted).")
@click.option("--no-verify", is_flag=True, help="Leave out the verify findings (saves a second read).")
def report(captures, output, max_points, top_keys, max_series, findings_limit, no_verify):
    """Draw captures as one self-contained HTML page of charts.

    \b
    A summary strip at the top (verify verdict, documents, changes, rollbacks and documents
    undone, unserved vbuckets, backfill, lag; Synapse rows, caught-up rows, gaps), then frames
    and bytes per second, changes per second by operation, the backfill apart, per-vbucket
    (per-stream and instance) progress, lag, rollbacks / stream ends / cluster map changes /
    reconnects on the time axis, snapshot kinds, segment sizes, the keys with the most changes,
    and the verify findings. The page inlines its scripts and opens from a file, offline.

    \b
    Example:
      dcptool report caps/ -o caps.html
    """
    from dcptool.cli.sources import capture_paths
    from dcptool.replay.check import report as R
    from dcptool.replay.store.discovery import check_output
    from dcptool.replay.store.reader import CaptureError, find_captures, protocol_of
    check_output(output)      # never over a capture file, never into a capture directory (exit 2)
    paths = capture_paths(captures)
    try:        # what the arguments name: not a capture, none, both protocols -> usage (2)
        files = find_captures(paths)
        protocol_of(files)
    except CaptureError as exc:
        raise click.UsageError(str(exc)) from None
    d = R.report(paths, output, files=files, max_points=max_points, top_keys=top_keys,
                 max_series=max_series, verify=not no_verify, findings_limit=findings_limit)
    click.echo(f"wrote {output}: {d.frames:,} frames, {len(d.segments)} segment(s)", err=True)
