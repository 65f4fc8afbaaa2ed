"""One rich console on stderr for progress, logs and errors; stdout carries only data."""

from __future__ import annotations

import functools
import sys


@functools.lru_cache(maxsize=1)
def err_console():
    from rich.console import Console
    return Console(file=sys.stderr, stderr=True)


def stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
