"""`dcptool restore CAPTURE... couchbase://HOST/BUCKET`: captured documents written back with
their metadata (the library: restore/run.py); the summary as the other commands print it."""

from __future__ import annotations

import json
import signal
import sys
import types

import click


@click.command("restore")
@click.argument("args", nargs=-1, required=True, metavar="CAPTURE... couchbase://HOST[:PORT][,HOST...]/BUCKET")
@click.option("--user", help="User name (or DCPTOOL_USER). The password comes from DCPTOOL_PASSWORD, "
              "--password-file, or a prompt on a TTY.")
@click.option("--password-file", type=click.Path(dir_okay=False), help="File holding the password (first line).")
@click.option("--as-of", "as_of_ts", default=None, metavar="TIME",
              help="The documents as of this moment (ISO 8601 or Unix seconds), as `replay --as-of`; "
                   "default: the end of the captures.")
@click.option("--keys", default=None, metavar="GLOB|/REGEX/",
              help="Only the keys matching a glob (user-*), or a regular expression between slashes.")
@click.option("--collection-map", "collection_map", multiple=True, metavar="SCOPE.COLL=SCOPE.COLL",
              help="Write a collection's documents into another collection (repeatable). A target "
                   "collection that does not exist: exit 2 before anything is written.")
@click.option("--force", is_flag=True,
              help="Skip the target's conflict resolution (SKIP_CONFLICT_RESOLUTION, as cbbackupmgr's "
                   "--force-updates): every document is written whatever version the target holds.")
@click.option("--replace-ttl", "replace_ttl", is_flag=True,
              help="Write documents whose expiry has passed with no expiry (default: skip and count them).")
@click.option("--dry-run", "dry_run", is_flag=True,
              help="Write nothing: print what would be written, one JSON line per document.")
@click.option("--window", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="Requests in flight per connection.")
@click.option("--timeout", default="30s", show_default=True, metavar="DURATION",
              help="How long a write may wait for its vbucket's owner (rebalances, failovers).")
@click.option("--json", "json_summary", is_flag=True, help="The summary as one JSON object on stdout.")
@click.option("--ca-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="couchbases://: the CA certificate to verify the server with.")
@click.option("--insecure", is_flag=True, help="couchbases://: TLS without certificate verification.")
@click.pass_context
def restore_cmd(ctx, args, user, password_file, as_of_ts, keys, collection_map, force, replace_ttl, dry_run, window,
                timeout, json_summary, ca_cert, insecure):
    """Write the documents of captures into a live bucket, metadata kept.

    Each key's last change in the captures (as of --as-of) is written with SET_WITH_META, a
    deletion with DEL_WITH_META as a tombstone: CAS, revision seqno, flags, expiry, datatype
    and xattrs as captured. The target's conflict resolution decides: a document it holds at
    a newer or equal version is left and counted (`skipped_target_newer_or_equal`), so a
    second run writes nothing and a run stopped half way and started again ends in the same
    bucket state. Cluster-aware (the map, NOT_MY_VBUCKET, rebalances) and pipelined.
    SIGINT stops it within 2 s with its summary (exit 130).

    \b
    Examples:
      DCPTOOL_PASSWORD=... dcptool restore caps/ couchbase://127.0.0.1/default --user admin
      dcptool restore caps/ couchbase://h1,h2/travel --as-of 2026-01-02T09:14:00Z --keys 'order-*'
    """
    from dcptool.cli.sources import (
        capture_paths,
        parse_duration,
        parse_source,
        read_password,
        user_from,
    )
    from dcptool.replay.rules.as_of import make_as_of
    from dcptool.replay.store import discovery
    from dcptool.restore import run as R

    if len(args) < 2:
        raise click.UsageError("give the captures, then the target couchbase://HOST/BUCKET")
    *captures, target = args
    source = parse_source(target)
    if source.protocol != "dcp" or not source.bucket:
        raise click.BadParameter(f"{target!r}: the target is couchbase://HOST[:PORT][,HOST...]/BUCKET",
                                 param_hint="TARGET")
    try:
        mapping = R.parse_collection_map(collection_map)
        as_of = make_as_of(as_of_ts, ())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    files = discovery.find_captures(capture_paths(captures))
    if discovery.protocol_of(files) != "dcp":
        raise click.UsageError("restore reads DCP captures only")
    opts = R.RestoreOptions(files=files, seeds=source.seed_list, bucket=source.bucket, as_of=as_of or None,
                            keys=keys, collection_map=mapping, force=force, replace_ttl=replace_ttl,
                            dry_run=dry_run, window=window, timeout=parse_duration(timeout, "--timeout"))
    if dry_run:
        counts = R.dry_run(opts, lambda row: sys.stdout.write(json.dumps(row) + "\n"))
        sys.stdout.flush()
        return _summary(counts, json_summary, to_stderr=True)
    opts.user = user_from(user, source.url)
    opts.password = read_password(password_file, needed=opts.user is not None, user=opts.user)
    if source.tls:
        from dcptool.protocol.transport.dcp_client import tls_context
        opts.tls = tls_context(ca_cert, insecure)
    counts = R.restore(opts, progress=_progress(), signals=(signal.SIGINT, signal.SIGTERM))
    _summary(counts, json_summary, to_stderr=False)
    if counts.interrupted:
        from dcptool.cli.exit_codes import Interrupted
        raise Interrupted(counts.signal or signal.SIGINT)
    if counts.failed:
        raise R.RestoreFailed(f"{counts.failed} document(s) refused by the target: {counts.statuses}")


def _progress():
    """A live line on a terminal (stderr), nothing otherwise."""
    if not sys.stderr.isatty():
        return lambda counts: None
    from dcptool.cli.view.console import err_console
    console = err_console()
    state = {"n": 0}

    def show(c) -> None:
        state["n"] += 1
        if state["n"] % 500 == 0:
            console.print(f"restore: {c.written} written, {c.skipped} skipped, {c.failed} failed", end="\r",
                          highlight=False, style="dim")
    return show


def _summary(counts, json_summary: bool, to_stderr: bool) -> None:
    from dcptool.cli.view.run_summary import print_stream_summary
    opts = types.SimpleNamespace(json_summary=json_summary, fmt="jsonl" if to_stderr else None)
    print_stream_summary(counts.summary(), opts)
