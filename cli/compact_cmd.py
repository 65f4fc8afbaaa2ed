"""`dcptool compact CAPTURE_DIR`: merge a capture directory's small finished segments
(replay/store/compact.py does the work)."""

from __future__ import annotations

import click


@click.command("compact")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def compact_cmd(directory):
    """Merge the small finished segments of a capture directory.

    Runs of consecutive finished segments of one capture, each under 8 MiB, become one
    merged segment each (rows, order and bytes kept); the parts are deleted once the merged
    segment is durable. Parts an interrupted compaction left next to their merged segment
    are deleted too. A directory a running capture writes into is refused.

    \b
    Example:
      dcptool compact ./captures && dcptool verify ./captures
    """
    from dcptool.replay.store.compact import compact
    res = compact(directory)
    parts = sum(m["parts"] for m in res.merged)
    text = (f"compacted {parts:,} segments into {len(res.merged):,} ({res.bytes_before:,} -> "
            f"{res.bytes_after:,} bytes)" if res.merged else "nothing to compact")
    if res.leftovers_removed:
        text += f"; removed {res.leftovers_removed:,} parts an interrupted compaction left"
    click.echo(f"{text} in {directory}", err=True)
