"""The live progress display of `dcptool capture` (stderr, rich) and its final summary.

The network loop calls `update()`/`add()` as often as it likes: they only store numbers
(live/progress.py).
Rendering (rates, formatting) happens on rich's refresh thread a few times a second, so
the cost on the loop is a few attribute stores. `make_progress` returns a no-op display
for `--quiet` or when stderr is not a terminal, so callers never need to check.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from rich.live import Live
from rich.table import Table

from dcptool.capture.run import NoProgress
from dcptool.cli.view.console import err_console
from dcptool.cli.view.output import printable
from dcptool.live.progress import ProgressCounters


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class NullProgress(NoProgress):
    """The display for --quiet and non-TTY stderr: every call is a no-op."""

    enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class CaptureProgress(ProgressCounters, NullProgress):
    """Live capture progress on the stderr console: the counters of live/progress.py
    (update(), add(), rates(), positions_text()) drawn by rich a few times a second."""

    enabled = True

    def update(self, **kw: Any) -> None:
        """ProgressCounters.update (NoProgress's takes any keywords: so does this one)."""
        ProgressCounters.update(self, **kw)

    def __init__(self, protocol: str, *, console=None, refresh_per_second: float = 4,
                 clock: Callable[[], float] = time.monotonic, start: bool = True):
        if console is None:
            console = err_console()
        ProgressCounters.__init__(self, protocol, clock=clock)
        self.console = console
        self._live = None
        if start:
            self._live = Live(get_renderable=self.render, console=console,
                              redirect_stdout=False, redirect_stderr=False,
                              refresh_per_second=refresh_per_second, transient=False)
            self._live.start()

    def render(self):
        """The display, laid out for the width of the console that draws it (grid)."""
        rates = self.rates()
        return _FitWidth(lambda width: self.grid(width, rates))

    def grid(self, width: int, rates: tuple[float, float]):
        """The display as a grid of at most `width` columns: the labels whole, each value
        cut with … at the edge, as many positions as fit (80 columns too)."""
        fps, bps = rates
        streams = "vbuckets" if self.protocol == "dcp" else "streams"
        labels = [f"{self.protocol} capture", "frames", "wire", streams, "written", "positions"]
        label_width = max(map(len, labels))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True, min_width=label_width)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        grid.add_row(f"{self.protocol} capture", _duration(self.clock() - self.t0)
                     + (f"  {self.note}" if self.note else ""))
        grid.add_row("frames", f"{self.frames:,}  ({fps:,.0f}/s)")
        grid.add_row("wire", f"{_size(self.wire_bytes)}  ({bps / 1e6:,.2f} MB/s)")
        grid.add_row(streams, f"{self.streams_open:,} streaming, {self.streams_ended:,} ended")
        grid.add_row("written", _size(self.bytes_written)
                     + (f"  (backlog {_size(self.backlog_bytes)})" if self.backlog_bytes else ""))
        pos = self.positions_text(max(20, width - label_width - 2))
        if pos:
            grid.add_row("positions", pos)
        return grid

    def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()


class _FitWidth:
    """A rich renderable made at draw time for the width it is drawn in."""

    def __init__(self, make: Callable[[int], Any]):
        self.make = make

    def __rich_console__(self, console, options):
        yield self.make(options.max_width)


def make_progress(protocol: str, *, quiet: bool = False, console=None):
    """A live display on stderr, or a no-op one for --quiet or when stderr is no terminal."""
    if console is None:
        console = err_console()
    if quiet or not console.is_terminal:
        return NullProgress()
    return CaptureProgress(protocol, console=console)


def print_summary(files: list[dict], *, json_summary: bool = False, quiet: bool = False,
                  extra: dict | None = None, console=None, stdout=None) -> dict:
    """The end-of-capture summary: files written with their rows and bytes, plus `extra`
    (capture_id, frames, vbuckets ...). As one JSON document on stdout with --json; as a
    table on stderr unless --quiet."""
    # the common fields of every run (cli/view/run_summary.py) come first in `extra`
    summary = dict(extra or {})
    summary.update(files=[dict(f) for f in files],
                   rows=sum(int(f.get("rows", 0)) for f in files),
                   bytes=sum(int(f.get("bytes", 0)) for f in files))
    if json_summary:
        out = stdout if stdout is not None else sys.stdout
        out.write(json.dumps(summary, default=str, separators=(",", ":")) + "\n")
        out.flush()
    if not quiet:
        if console is None:
            console = err_console()
        table = Table(title="capture written", title_justify="left", show_footer=True)
        table.add_column("file", footer="total")
        table.add_column("rows", justify="right", footer=f"{summary['rows']:,}")
        table.add_column("bytes", justify="right", footer=_size(summary["bytes"]))
        for f in files:
            table.add_row(str(f.get("path")), f"{int(f.get('rows', 0)):,}",
                          _size(int(f.get("bytes", 0))))
        console.print(table)
        for key, value in (extra or {}).items():
            if value is not None and not isinstance(value, (dict, list)):
                console.print(f"{key}: {printable(value)}", highlight=False, markup=False)
    return summary
