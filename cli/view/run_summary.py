"""What a `stream` run prints when it ends (the summary line or JSON, the same for DCP and
Synapse). The summary's fields and the signals that end a run or a `serve` are library
(capture/run.py, serve/runner.py)."""

from __future__ import annotations

import json
import sys

from dcptool.cli.view.console import err_console, stdout_is_tty
from dcptool.cli.view.output import printable
from dcptool.live.view_filter import RowFilter


class NullSink:
    """`stream --json` without `--format`: the rows are counted, not printed (stdout carries
    the JSON summary alone)."""
    fmt = "none"
    columns = None

    def __init__(self):
        self.count = 0

    def write(self, row) -> None:
        self.count += 1

    def write_many(self, rows) -> None:
        for _ in rows:
            self.count += 1

    def write_jsonl(self, data, count: int) -> None:
        self.count += count

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def stream_sink(opts, make):
    """The sink of a `stream` run: `make()` (rows printed), or a NullSink with `--json` and
    no `--format`."""
    return NullSink() if getattr(opts, "json_summary", False) and not opts.fmt else make()


def live_view(fmt: str, opts, ops: frozenset[str] | None, key: str | None) -> RowFilter:
    """Which rows a `stream` run prints: `--ops` / `--key` in every format; the live table on
    a terminal leaves out the connection's own traffic unless -v (live/view_filter.py)."""
    quiet = fmt == "table" and stdout_is_tty() and not getattr(opts, "verbose", False)
    return RowFilter(ops, key, quiet=quiet)


def add_rates(summary: dict, ops: dict | None = None) -> dict:
    """`rate` (messages received per second) and, for DCP, `ops` (frames shown per op name,
    both directions) after the other fields."""
    secs = summary.get("seconds") or 0
    summary["rate"] = round(summary.get("messages_in", 0) / secs, 1) if secs > 0 else None
    if ops is not None:
        summary["ops"] = dict(sorted(ops.items()))
    return summary


def print_stream_summary(summary: dict, opts=None) -> None:
    """The end of `stream`: one line on stderr, `key=value` pairs (stdout carries only rows).
    With `--json` (opts.json_summary): the summary as one JSON object, on stdout when the
    rows are not printed (no `--format`), else as one line on stderr."""

    if opts is not None and getattr(opts, "json_summary", False):
        text = json.dumps(summary, default=str) + "\n"
        out = sys.stderr if opts.fmt else sys.stdout
        out.write(text)
        out.flush()
        return
    parts = []
    for k, v in summary.items():
        if v is None or isinstance(v, (dict, list)):
            continue
        text = printable(v)
        parts.append(f"{k}={text}" if " " not in text else f'{k}="{text}"')
    con = err_console()   # a terminal wraps it between its pairs; a log gets one line
    con.print("summary: " + " ".join(parts), highlight=False, style="dim", soft_wrap=not con.is_terminal,
              markup=False)


def run_and_close(run, sink):
    """`run()`, then the sink closed whatever happened. Returns (run's result, the first
    error or None): the caller prints its summary before it re-raises the error."""
    result, error = None, None
    try:
        result = run()
    except BaseException as exc:  # noqa: BLE001 - the summary first, then it is re-raised
        error = exc
    finally:
        try:
            sink.close()
        except BaseException as exc:  # noqa: BLE001 - a closed stdout
            error = error or exc
    return result, error
