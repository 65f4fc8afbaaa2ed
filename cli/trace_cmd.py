"""`dcptool trace CAPTURE... KEY...`: the story of DCP keys (replay/check/trace.py; --spark:
replay/spark/trace.py), or of Synapse events with --event-id (replay/check/trace_synapse.py),
then verdicts. JSON lines in a pipe, a table on a terminal. Exit 0 (not_seen is a verdict)."""

from __future__ import annotations

import os

import click

from dcptool.cli.sources import capture_paths
from dcptool.cli.view.output import Sink, default_format

# Lazy imports: only where start-up time needs them (`trace --help` loads no pyarrow or
# pandas: the DCP, Synapse or Spark trace loads when the command runs).


def _split(args: tuple, events: bool) -> tuple[list[str], list[str]]:
    """CAPTURE... KEY...: the leading arguments that are existing paths (or `-`) are captures,
    the rest keys; at least one of each (with --event-id, every argument is a capture)."""
    if events:
        return list(args), []
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
@click.option("--event-id", "event_ids", multiple=True, metavar="ID",
              help="Synapse: trace this event id (repeatable); every argument is then a capture.")
@click.option("--spark", "use_spark", is_flag=True,
              help="DCP: read the captures on Spark (same output), for captures that need a cluster.")
@click.option("--master", default="local[*]", show_default=True, metavar="URL",
              help="The Spark master of --spark.")
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl", "text"]), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
def trace(args, collection, vbucket, event_ids, use_spark, master, fmt):
    """Explain DCP keys: every event that touched each KEY, then a verdict.

    \b
    One row per event, in capture order: each change received (op, seqno, cas, node, conn,
    frame_no, ts, and the snapshot it came in: memory, disk, oso, +history), each rollback
    that undid one of its changes (and whether a later change restored it), stream ends,
    resumes, re-routes and cluster-map moves of its vbucket after its first change, a drop of
    its collection. Then one `verdict` row per key: live, deleted, expired, undone or
    not_seen, with `explain`, one sentence. Exit 0.

    \b
    Synapse (--event-id ID): the RDATA rows that carried the event, then a verdict: seen,
    or not_seen with the gaps of the streams that carry event ids.

    \b
    Examples:
      dcptool trace caps/ airline_10 airline_11
      dcptool trace caps/ route_5 --collection inventory.route --format jsonl | jq -r .explain
      dcptool trace caps/ airline_10 --spark --master local[2]
      dcptool trace syncaps/ --event-id '$pJ17a9n_F6-oCqyNpeNNG6LHI-jrGk4oA1F5TQeHdRA'
    """
    from dcptool.replay.check import trace as T
    caps, keys = _split(args, bool(event_ids))
    if event_ids and (use_spark or collection is not None or vbucket is not None):
        raise click.UsageError("--event-id (Synapse) takes none of --spark, --collection, --vbucket")
    raw = [k.encode("utf-8", "surrogateescape") for k in keys]
    try:
        if event_ids:
            from dcptool.replay.check.trace_synapse import SYNAPSE_COLUMNS as columns  # noqa: N811 - the columns of this trace
            from dcptool.replay.check.trace_synapse import trace_synapse
            rows = trace_synapse(capture_paths(caps), list(event_ids))
        elif use_spark:
            from dcptool.replay.spark.trace import trace_on_spark
            rows, columns = trace_on_spark(capture_paths(caps), raw, master, collection, vbucket), T.TRACE_COLUMNS
        else:
            rows, columns = T.trace(capture_paths(caps), raw, collection, vbucket), T.TRACE_COLUMNS
    except T.TraceError as exc:
        raise click.UsageError(str(exc)) from None
    sink = Sink(default_format(fmt), columns=columns, title="trace")
    sink.write_many(rows)
    sink.close()
