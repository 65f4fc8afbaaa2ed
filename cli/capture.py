"""`dcptool capture SOURCE`: record every frame or line, both directions, into Parquet."""

from __future__ import annotations

import click

from dcptool.cli.live import build_options, connection_options, runner
from dcptool.cli.sources import parse_duration, parse_size


@click.command()
@connection_options
@click.option("-o", "--output", default="./captures", show_default=True,
              type=click.Path(file_okay=False), help="Directory for the capture segments.")
@click.option("--rotate-size", default="256MiB", show_default=True, help="Start a new segment after this many bytes.")
@click.option("--rotate-interval", default="5m", show_default=True, help="Start a new segment after this long.")
@click.option("--compression", type=click.Choice(["zstd", "snappy", "none"]), default="zstd",
              show_default=True)
@click.option("--resume", is_flag=True,
              help="Continue from the state recorded in the captures already in the output directory.")
@click.option("--quiet", is_flag=True, help="No live progress on stderr.")
@click.option("--json", "json_summary", is_flag=True, help="Print the final summary as JSON on stdout.")
@click.pass_context
def capture(ctx, output, rotate_size, rotate_interval, compression, resume, quiet, json_summary, **kw):
    """Record SOURCE into timestamped Parquet captures under --output.

    \b
    Example:
      DCPTOOL_PASSWORD=... dcptool capture couchbase://127.0.0.1/default --user admin -o caps
    """
    opts = build_options(ctx, kw)
    settings = dict(output=output, rotate_size=parse_size(rotate_size, "--rotate-size"),
                    rotate_interval=parse_duration(rotate_interval, "--rotate-interval"),
                    compression=compression, resume=resume, quiet=quiet, json_summary=json_summary)
    runner(opts.source.protocol, "run_capture")(opts, settings)
