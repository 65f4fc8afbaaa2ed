"""The live progress display of `dcptool capture` (stderr, rich) and its final summary.

The network loop calls `update()`/`add()` as often as it likes: they only store numbers.
Rendering (rates, formatting) happens on rich's refresh thread a few times a second, so
the cost on the loop is a few attribute stores. `make_progress` returns a no-op display
for `--quiet` or when stderr is not a terminal, so callers never need to check.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Callable, Mapping

_MAX_POSITIONS = 8


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class NullProgress:
    """The display for --quiet and non-TTY stderr: every call is a no-op."""

    enabled = False

    def update(self, **_kw) -> None:
        pass

    def add(self, frames: int = 0, wire_bytes: int = 0) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class CaptureProgress(NullProgress):
    """Live capture progress on the stderr console.

    update() sets totals (any subset): frames, wire_bytes, streams_open, streams_ended,
    positions (a mapping vbucket -> last seqno, or "stream/instance" -> token; the live
    dict may be passed once and mutated afterwards), bytes_written, backlog_bytes, note.
    add(frames, wire_bytes) increments the two counters instead.
    """

    enabled = True

    def __init__(self, protocol: str, *, console=None, refresh_per_second: float = 4,
                 clock: Callable[[], float] = time.monotonic, start: bool = True):
        if console is None:
            from dcptool.cli.view.console import err_console
            console = err_console()
        self.console = console
        self.protocol = protocol
        self.clock = clock
        self.frames = 0
        self.wire_bytes = 0
        self.streams_open = 0
        self.streams_ended = 0
        self.positions: Mapping = {}
        self.bytes_written = 0
        self.backlog_bytes = 0
        self.note = ""
        self._t0 = clock()
        self._samples: collections.deque = collections.deque(maxlen=64)
        self._live = None
        if start:
            from rich.live import Live
            self._live = Live(get_renderable=self.render, console=console,
                              redirect_stdout=False, redirect_stderr=False,
                              refresh_per_second=refresh_per_second, transient=False)
            self._live.start()

    def update(self, *, frames=None, wire_bytes=None, streams_open=None, streams_ended=None,
               positions=None, bytes_written=None, backlog_bytes=None, note=None) -> None:
        if frames is not None:
            self.frames = frames
        if wire_bytes is not None:
            self.wire_bytes = wire_bytes
        if streams_open is not None:
            self.streams_open = streams_open
        if streams_ended is not None:
            self.streams_ended = streams_ended
        if positions is not None:
            self.positions = positions
        if bytes_written is not None:
            self.bytes_written = bytes_written
        if backlog_bytes is not None:
            self.backlog_bytes = backlog_bytes
        if note is not None:
            self.note = note

    def add(self, frames: int = 0, wire_bytes: int = 0) -> None:
        self.frames += frames
        self.wire_bytes += wire_bytes

    def rates(self) -> tuple[float, float]:
        """(frames/s, bytes/s) over the last few seconds."""
        now = self.clock()
        self._samples.append((now, self.frames, self.wire_bytes))
        while len(self._samples) > 2 and now - self._samples[0][0] > 3.0:
            self._samples.popleft()
        t0, f0, b0 = self._samples[0]
        if now - t0 <= 0:
            return 0.0, 0.0
        return (self.frames - f0) / (now - t0), (self.wire_bytes - b0) / (now - t0)

    def _positions_text(self) -> str:
        try:
            items = list(self.positions.items())
        except RuntimeError:  # mutated while we looked: show it next time
            return ""
        if not items:
            return ""
        label = "last seqno" if self.protocol == "dcp" else "tokens"
        items.sort(key=lambda kv: (str(type(kv[0])), kv[0]))
        shown = items[:_MAX_POSITIONS]
        if self.protocol == "dcp":
            text = "  ".join(f"vb{k}={v}" for k, v in shown)
        else:
            text = "  ".join(f"{k}={v}" for k, v in shown)
        if len(items) > len(shown):
            text += f"  … +{len(items) - len(shown)} more"
        return f"{label}: {text}"

    def render(self):
        from rich.table import Table
        fps, bps = self.rates()
        streams = "vbuckets" if self.protocol == "dcp" else "streams"
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column(no_wrap=True)
        grid.add_row(f"{self.protocol} capture", _duration(self.clock() - self._t0)
                     + (f"  {self.note}" if self.note else ""))
        grid.add_row("frames", f"{self.frames:,}  ({fps:,.0f}/s)")
        grid.add_row("wire", f"{_size(self.wire_bytes)}  ({bps / 1e6:,.2f} MB/s)")
        grid.add_row(streams, f"{self.streams_open:,} streaming, {self.streams_ended:,} ended")
        grid.add_row("written", _size(self.bytes_written)
                     + (f"  (backlog {_size(self.backlog_bytes)})" if self.backlog_bytes else ""))
        pos = self._positions_text()
        if pos:
            grid.add_row("positions", pos)
        return grid

    def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()


def make_progress(protocol: str, *, quiet: bool = False, console=None):
    """A live display on stderr, or a no-op one for --quiet or when stderr is no terminal."""
    if console is None:
        from dcptool.cli.view.console import err_console
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
        import json
        out = stdout if stdout is not None else sys.stdout
        out.write(json.dumps(summary, default=str, separators=(",", ":")) + "\n")
        out.flush()
    if not quiet:
        from rich.table import Table
        if console is None:
            from dcptool.cli.view.console import err_console
            console = err_console()
        table = Table(title="capture written", title_justify="left", show_footer=True)
        table.add_column("file", footer="total")
        table.add_column("rows", justify="right", footer=f"{summary['rows']:,}")
        table.add_column("bytes", justify="right", footer=_size(summary["bytes"]))
        for f in files:
            table.add_row(str(f.get("path")), f"{int(f.get('rows', 0)):,}",
                          _size(int(f.get("bytes", 0))))
        console.print(table)
        from dcptool.cli.view.output import printable
        for key, value in (extra or {}).items():
            if value is not None and not isinstance(value, (dict, list)):
                console.print(f"{key}: {printable(value)}", highlight=False, markup=False)
    return summary
