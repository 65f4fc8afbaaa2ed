"""`dcptool stream SOURCE`: a live, decoded view of a DCP or Synapse stream."""

from __future__ import annotations

import click

from dcptool.cli.exit_codes import StdoutClosed
from dcptool.cli.live import build_options, connection_options, runner
from dcptool.cli.process import stdout_closed
from dcptool.cli.view.output import FORMATS


@click.command()
@connection_options
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="table on a TTY, jsonl in a pipe (default).")
@click.option("--values", is_flag=True, help="Include document values / row JSON (base64 for bytes).")
@click.option("--raw", is_flag=True, help="Include the whole frame or line, base64.")
@click.option("--json", "json_summary", is_flag=True,
              help="Print the final summary as one JSON object: on stdout, with no rows printed, unless "
              "--format is given (then the rows go to stdout and the JSON summary to stderr).")
@click.pass_context
def stream(ctx, **kw):
    """Open SOURCE and print each decoded message as it arrives.

    \b
    Examples:
      dcptool stream couchbase://127.0.0.1:11210/default --vbuckets 0-3 | jq .op
      dcptool stream synapse+redis://127.0.0.1:6379?server_name=example.org --format table
    """
    opts = build_options(ctx, kw)
    if stdout_closed():   # every row and the --json summary go there: say so before connecting
        raise StdoutClosed()
    runner(opts.source.protocol, "stream")(opts)
