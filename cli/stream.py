"""`dcptool stream SOURCE`: a live, decoded view of a DCP or Synapse stream."""

from __future__ import annotations

import click

from dcptool.cli.exit_codes import StdoutClosed
from dcptool.cli.live import build_options, connection_options, runner
from dcptool.cli.process import stdout_closed
from dcptool.cli.view.output import FORMATS
from dcptool.live.view_filter import parse_ops


@click.command()
@connection_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
@click.option("--values", is_flag=True, help="Include document values / row JSON (base64 for bytes).")
@click.option("--raw", is_flag=True, help="Include the whole frame or line, base64.")
@click.option("--json", "json_summary", is_flag=True,
              help="Print the final summary as one JSON object: on stdout, with no rows printed, unless "
              "--format is given (then the rows go to stdout and the JSON summary to stderr).")
@click.option("--ops", default=None, metavar="LIST",
              help="Print only these DCP ops (mutation,deletion) / Synapse commands (rdata,position), in "
              "every format.")
@click.option("--key", "key_glob", default=None, metavar="GLOB",
              help="Print only the rows whose DCP key (Synapse: a field of the row, e.g. an event or room "
              "id) matches GLOB, e.g. 'doc-1*'.")
@click.pass_context
def stream(ctx, ops, key_glob, **kw):
    """Open SOURCE and print each decoded message as it arrives.

    \b
    Examples:
      dcptool stream couchbase://127.0.0.1:11210/default --vbuckets 0-3 | jq .op
      dcptool stream synapse+redis://127.0.0.1:6379?server_name=example.org --format table
      dcptool stream couchbase://127.0.0.1:11210/default --ops mutation,deletion --key 'doc-1*'
    """
    opts = build_options(ctx, kw)
    try:
        wanted = parse_ops(ops, opts.source.protocol) if ops is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--ops") from None
    if stdout_closed():   # every row and the --json summary go there: say so before connecting
        raise StdoutClosed()
    runner(opts.source.protocol, "stream")(opts, ops=wanted, key=key_glob)
