"""`dcptool trace CAPTURE... KEY...`: the story of DCP keys in captures (replay/check/trace.py,
in-process or with `--spark` on Spark, replay/spark/trace.py): one row per event that touched
each key, then its verdict; `trace CAPTURE... --event-id ID`: the RDATA rows of Synapse events
(replay/check/trace_synapse.py). JSON lines in a pipe, a table on a terminal. Exit 0 (a key
never seen is a verdict, not an error)."""

from __future__ import annotations

import os

import click

from dcptool.cli.view.output import Sink, default_format


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
    \b
    Synapse (--event-id ID): one `rdata` row per RDATA row that carried the event (stream,
    instance, token as sent, the token that committed it, conn, frame_no, ts), then a
    `verdict` row: seen, or not_seen with the gaps (`gap` rows: tokens a POSITION said were
    never received) of the streams that carry event ids.

    \b
    Examples:
      dcptool trace caps/ airline_10 airline_11
      dcptool trace caps/ route_5 --collection inventory.route --format jsonl | jq -r .explain
      dcptool trace caps/ airline_10 --spark --master local[2]
      dcptool trace syncaps/ --event-id '$pJ17a9n_F6-oCqyNpeNNG6LHI-jrGk4oA1F5TQeHdRA'
    """
    from dcptool.cli.sources import capture_paths
    from dcptool.replay.check import trace as T
    caps, keys = _split(args, bool(event_ids))
    if event_ids:
        if use_spark or collection is not None or vbucket is not None:
            raise click.UsageError("--event-id (Synapse) takes none of --spark, --collection, --vbucket")
        rows, columns = _synapse(capture_paths(caps), list(event_ids)), None
    else:
        try:
            rows = _dcp(capture_paths(caps), keys, collection, vbucket, master if use_spark else None)
        except T.TraceError as exc:
            raise click.UsageError(str(exc)) from None
        columns = T.TRACE_COLUMNS
    if columns is None:
        from dcptool.replay.check.trace_synapse import SYNAPSE_COLUMNS as columns
    sink = Sink(default_format(fmt), columns=columns, title="trace")
    sink.write_many(rows)
    sink.close()


def _dcp(paths: list[str], keys: list[str], collection, vbucket, master: str | None) -> list[dict]:
    from dcptool.replay.check import trace as T
    raw = [k.encode("utf-8", "surrogateescape") for k in keys]
    if master is None:
        return T.trace(paths, raw, collection=collection, vbucket=vbucket)
    import warnings
    warnings.filterwarnings("ignore", module="pyspark")
    from dcptool.replay.spark import engine
    from dcptool.replay.spark.trace import SparkRows
    session = engine.make_session(master)
    opened: list = []

    def rows_of(cap):
        opened.append(SparkRows(session, cap))
        return opened[-1]
    try:
        return T.trace(paths, raw, collection=collection, vbucket=vbucket, engine=rows_of)
    finally:
        for r in opened:
            r.close()
        engine.stop_session(session)


def _synapse(paths: list[str], event_ids: list[str]) -> list[dict]:
    from dcptool.replay.check.trace_synapse import trace_events
    from dcptool.replay.store import reader
    files = reader.find_captures(paths)
    if reader.protocol_of(files) != "synapse":
        raise click.UsageError("--event-id traces Synapse events; these are DCP captures (give KEYs)")
    return trace_events(files, event_ids)
