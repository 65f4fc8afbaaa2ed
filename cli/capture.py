"""`dcptool capture SOURCE`: record every frame or line, both directions, into Parquet."""

from __future__ import annotations

import os

import click

from dcptool.capture.options import CaptureSettings
from dcptool.capture.shard import check_shard
from dcptool.cli.exit_codes import LateUsageError
from dcptool.cli.live import build_options, connection_options, runner
from dcptool.cli.sources import output_dir_option, parse_duration, parse_size
from dcptool.cli.view.console import err_console
from dcptool.replay.store import COMPRESSIONS

# Lazy imports: only where start-up time needs them (`capture --help` loads no pyarrow:
# the resume checks import the capture store when the run starts).


@click.command()
@connection_options
@output_dir_option("Directory for the capture segments.", default=CaptureSettings.output)
@click.option("--rotate-size", default=None, show_default="256MiB",
              help="Start a new segment after this many bytes.")
@click.option("--rotate-interval", default=None, show_default="5m",
              help="Start a new segment after this long.")
@click.option("--compression", type=click.Choice(COMPRESSIONS), default=None,
              show_default=CaptureSettings.compression)
@click.option("--resume", is_flag=True,
              help="Continue from the state recorded in the captures already in the output directory.")
@click.option("--force-new", "force_new", is_flag=True,
              help="Start a new capture (a new capture id) even though the output directory holds a "
                   "capture of another source or bucket (same protocol only); the old one is kept as it is.")
@click.option("--retain-segments", type=click.IntRange(min=1), help="Ring: keep the newest N finished segments.")
@click.option("--retain-size", help="Ring: delete the oldest finished segments beyond SIZE in all, e.g. 50GiB.")
@click.option("--retain-age", help="Ring: delete finished segments older than this, e.g. 7d.")
@click.option("--shard", metavar="K/N", help="DCP: only the vbuckets with vb % N == K-1 (of --vbuckets).")
@click.option("--catch-up", "catch_up", multiple=True, metavar="INSTANCE=URL",
              help="Synapse: fetch missed rows from this writer's replication listener (repeatable; "
                   "secret from DCPTOOL_REPLICATION_SECRET).")
@click.option("--quiet", is_flag=True, help="No live progress on stderr.")
@click.option("--json", "json_summary", is_flag=True, help="Print the final summary as JSON on stdout.")
@click.pass_context
def capture(ctx, output, output_alias, rotate_size, rotate_interval, compression, resume, force_new,
            retain_segments, retain_size, retain_age, shard, catch_up, quiet, json_summary, **kw):
    """Record SOURCE into timestamped Parquet captures under --output.

    \b
    Example:
      DCPTOOL_PASSWORD=... dcptool capture couchbase://127.0.0.1/default --user admin -o caps
    """
    opts = build_options(ctx, kw)
    opts.shard = check_shard(shard, opts.source.protocol)
    given = dict(output=output or output_alias, compression=compression, resume=resume, force_new=force_new, quiet=quiet,
                 json_summary=json_summary, retain_segments=retain_segments,
                 retain_size=parse_size(retain_size, "--retain-size") if retain_size else None,
                 retain_age=parse_duration(retain_age, "--retain-age") if retain_age else None,
                 rotate_size=parse_size(rotate_size, "--rotate-size") if rotate_size else None,
                 rotate_interval=parse_duration(rotate_interval, "--rotate-interval") if rotate_interval else None)
    given.update(_catch_up(catch_up, opts.source.protocol))
    settings = CaptureSettings(**{k: v for k, v in given.items() if v is not None})
    if resume and force_new:
        raise click.UsageError("--force-new starts a new capture: it does not combine with --resume")
    _one_source(settings.output, opts.source, resume=resume, force_new=force_new)
    from dcptool.capture.lock import hold
    # one writer per directory and shard, from --resume's recovery to the end-of-run merge
    with hold(settings.output, shard=opts.shard):
        if resume:
            _recover(settings.output)
        runner(opts.source.protocol, "capture")(opts, settings)


for _p in capture.params:     # every option from the environment too: DCPTOOL_CAPTURE_ROTATE_SIZE ...
    if isinstance(_p, click.Option) and not _p.hidden and _p.envvar is None:
        _p.envvar = "DCPTOOL_CAPTURE_" + max(_p.opts, key=len).lstrip("-").upper().replace("-", "_")
        _p.show_envvar = True


def _catch_up(values: tuple[str, ...], protocol: str) -> dict:
    """--catch-up INSTANCE=URL values (Synapse only) and the secret from the environment."""
    from dcptool.capture.synapse_catchup import settings_of
    try:
        return settings_of(values, protocol)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _one_source(directory: str, source, *, resume: bool, force_new: bool) -> None:
    """A capture directory holds one protocol and one source (replay/store/resume.py): another
    one is a usage error naming both, before anything connects."""
    from dcptool.replay.store import resume as R
    if resume and not os.path.isdir(directory):      # a mistyped directory: never made and "resumed"
        raise LateUsageError(f"--resume: {directory} does not exist: nothing to resume (check the path)")
    try:
        # the identity where the URL names it (Synapse's server_name), else the connection tells
        R.check_source(directory, source.protocol, source.url, resume=resume, force_new=force_new,
                       source_id=R.server_identity(source.server_name) or None)
    except R.SourceMismatch as exc:
        raise LateUsageError(str(exc)) from None


def _recover(directory: str) -> None:
    """--resume: the in-progress segments a killed run left are finished first (under the
    directory's lock); a damaged one is kept aside and said, a torn tail dropped and said."""
    from dcptool.replay.store import resume as R
    done = R.recover_first(directory)
    for note in done.damaged:
        err_console().print(f"dcptool: warning: {note}", highlight=False, markup=False, soft_wrap=True)
    for note in done.torn:     # the end of a log a crash or a full disk cut short: information
        err_console().print(f"dcptool: {note}", highlight=False, markup=False, soft_wrap=True)
