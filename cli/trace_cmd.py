"""`dcptool trace CAPTURE... KEY...`: the story of DCP keys in captures (replay/check/trace.py):
one row per event that touched each key, then its verdict. JSON lines in a pipe, a table
on a terminal. Exit 0 (a key never seen is a verdict, not an error)."""

from __future__ import annotations

import os

import click

from dcptool.cli.view.output import Sink, default_format


def _split(args: tuple) -> tuple[list[str], list[str]]:
    """CAPTURE... KEY...: the leading arguments that are existing paths (or `-`) are captures,
    the rest keys; at least one of each."""
    caps: list[str] = []
    i = 0
    while i < len(args) - 1 and (args[i] == "-" or os.path.exists(args[i])):
        caps.append(args[i])
        i += 1
    keys = list(args[i:])
    if not caps:
        raise click.UsageError(f"no capture given: {args[0]!r} is not a file or directory")
    if not keys:
        raise click.UsageError("no KEY given")
    return caps, keys


@click.command("trace")
@click.argument("args", nargs=-1, required=True, metavar="CAPTURE... KEY...")
@click.option("--collection", default=None, metavar="S.C",
              help="The key's collection: SCOPE.NAME (resolved with the capture's collections manifest) "
                   "or its id (0x8). Default: the key in any collection.")
@click.option("--vbucket", type=click.IntRange(0, 1023), default=None,
              help="The key's vbucket (default: from the key's rows, else Couchbase's CRC32 hash over the "
                   "capture's vbucket count).")
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl", "text"]), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
def trace(args, collection, vbucket, fmt):
    """Explain DCP keys: every event that touched each KEY, then a verdict.

    \b
    One row per event, in capture order: each change received (op, seqno, cas, node, conn,
    frame_no, ts, and the snapshot it came in: memory, disk, oso, +history), each rollback
    that undid one of its changes (and whether a later change restored it), stream ends,
    resumes, re-routes and cluster-map moves of its vbucket after its first change, a drop of
    its collection. Then one `verdict` row per key: live, deleted, expired, undone or
    not_seen, with `explain`, one sentence. Exit 0.

    \b
    Examples:
      dcptool trace caps/ airline_10 airline_11
      dcptool trace caps/ route_5 --collection inventory.route --format jsonl | jq -r .explain
    """
    from dcptool.cli.sources import capture_paths
    from dcptool.replay.check import trace as T
    caps, keys = _split(args)
    try:
        rows = T.trace(capture_paths(caps), [k.encode("utf-8", "surrogateescape") for k in keys],
                       collection=collection, vbucket=vbucket)
    except T.TraceError as exc:
        raise click.UsageError(str(exc)) from None
    sink = Sink(default_format(fmt), columns=T.TRACE_COLUMNS, title="trace")
    sink.write_many(rows)
    sink.close()
