"""`dcptool capture SOURCE`: record every frame or line, both directions, into Parquet."""

from __future__ import annotations

import click

from dcptool.capture.options import CaptureSettings
from dcptool.cli.live import build_options, connection_options, output_dir_option, runner
from dcptool.cli.sources import parse_duration, parse_size
from dcptool.replay.store import COMPRESSIONS


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
              help="Start a new capture even though the output directory holds a capture of another "
                   "source (same protocol only).")
@click.option("--retain-segments", type=click.IntRange(min=1), default=None,
              help="Ring: keep only the newest N finished segments (the oldest are deleted).")
@click.option("--retain-size", default=None,
              help="Ring: delete the oldest finished segments while together they hold more than SIZE, e.g. 50GiB.")
@click.option("--retain-age", default=None,
              help="Ring: delete finished segments older than this, e.g. 7d.")
@click.option("--shard", default=None, metavar="K/N",
              help="DCP: stream only the vbuckets with vb % N == K-1 (of --vbuckets); N processes with "
                   "1/N .. N/N may write one --output at once.")
@click.option("--quiet", is_flag=True, help="No live progress on stderr.")
@click.option("--json", "json_summary", is_flag=True, help="Print the final summary as JSON on stdout.")
@click.pass_context
def capture(ctx, output, output_alias, rotate_size, rotate_interval, compression, resume, force_new,
            retain_segments, retain_size, retain_age, shard, quiet, json_summary, **kw):
    """Record SOURCE into timestamped Parquet captures under --output.

    \b
    Example:
      DCPTOOL_PASSWORD=... dcptool capture couchbase://127.0.0.1/default --user admin -o caps
    """
    opts = build_options(ctx, kw)
    opts.shard = _shard(shard, opts.source.protocol)
    given = dict(output=output or output_alias, compression=compression, resume=resume, quiet=quiet,
                 json_summary=json_summary, retain_segments=retain_segments,
                 retain_size=parse_size(retain_size, "--retain-size") if retain_size else None,
                 retain_age=parse_duration(retain_age, "--retain-age") if retain_age else None,
                 rotate_size=parse_size(rotate_size, "--rotate-size") if rotate_size else None,
                 rotate_interval=parse_duration(rotate_interval, "--rotate-interval") if rotate_interval else None)
    settings = CaptureSettings(**{k: v for k, v in given.items() if v is not None})
    if resume and force_new:
        raise click.UsageError("--force-new starts a new capture: it does not combine with --resume")
    _one_source(settings.output, opts.source, resume=resume, force_new=force_new)
    runner(opts.source.protocol, "capture")(opts, settings)


def _shard(text: str | None, protocol: str) -> str | None:
    from dcptool.capture.shard import check_shard
    from dcptool.protocol.errors import LateUsageError
    if text is None:
        return None
    if protocol != "dcp":
        raise click.UsageError("--shard is for DCP: a Synapse capture is one stream set")
    try:
        return check_shard(text)
    except LateUsageError as exc:
        raise click.UsageError(str(exc)) from None


def with_env(command: click.Command, prefix: str) -> click.Command:
    """Every option of `command` may also come from the environment, as PREFIX_<OPTION>
    (--rotate-size: DCPTOOL_CAPTURE_ROTATE_SIZE); the command line wins. --help shows it."""
    for p in command.params:
        if isinstance(p, click.Option) and not p.hidden and p.envvar is None:
            longest = max((o for o in p.opts if o.startswith("--")), key=len)
            p.envvar = prefix + longest[2:].upper().replace("-", "_")
            p.show_envvar = True
    return command


with_env(capture, "DCPTOOL_CAPTURE_")


def _one_source(directory: str, source, *, resume: bool, force_new: bool) -> None:
    """A capture directory holds one protocol and one source (replay/store/resume.py): another
    one is a usage error naming both, before anything connects. With --resume the in-progress
    segments a killed run left are finished here first; a damaged one is kept aside and said."""
    from dcptool.cli.view.console import err_console
    from dcptool.cli.errors import LateUsageError
    from dcptool.replay.store import resume as R
    try:
        R.check_source(directory, source.protocol, source.url, resume=resume, force_new=force_new)
    except R.SourceMismatch as exc:
        raise LateUsageError(str(exc)) from None
    if resume:
        done = R.recover_first(directory)
        for note in done.damaged:
            err_console().print(f"dcptool: warning: {note}", highlight=False, markup=False, soft_wrap=True)
