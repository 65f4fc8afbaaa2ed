"""The one timestamp format of every output (docs/CLI.md "Output contract"): nanoseconds since
the epoch as RFC 3339 UTC with exactly nine fraction digits and `Z`. The CLI prints it
(cli/view/output.py), the capture summary (replay/check/summary.py) reports it."""

from __future__ import annotations

import time
from typing import overload

_NS = 1_000_000_000
_last_sec: list[int | str | None] = [None, ""]


@overload
def iso_ns(ns: int) -> str: ...
@overload
def iso_ns(ns: None) -> None: ...
@overload
def iso_ns(ns: int | None) -> str | None: ...
def iso_ns(ns: int | None) -> str | None:
    """Nanoseconds since the epoch as RFC 3339 UTC with exactly 9 fraction digits and `Z`
    (`2026-11-25T01:20:42.123456789Z`); None stays None. The one timestamp format of every
    command's output."""
    if ns is None:
        return None
    sec, frac = divmod(int(ns), _NS)
    if sec != _last_sec[0]:  # rows come in time order: format each second once
        try:
            head = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        except (OverflowError, OSError, ValueError):
            head = ""
        if len(head) != 19:  # a year outside 1000..9999 (a hostile value): no fake date
            return f"{int(ns)}ns"
        _last_sec[0], _last_sec[1] = sec, head
    return f"{_last_sec[1]}.{frac:09d}Z"
