"""`dcptool compact CAPTURE_DIR`: replay/store/compact.py does the work (CLI.md)."""
import click

from dcptool.replay.store.compact import compact


@click.command("compact", help="Merge the small finished segments of a capture directory (rows and bytes kept).")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def compact_cmd(directory):
    from dcptool.capture.lock import hold
    with hold(directory, command="compact"):     # never beside a live capture (its end-of-run merge too)
        done = compact(directory)
    click.echo(f"{done.summary()} in {directory}", err=True)
