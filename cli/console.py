"""One rich console on stderr for progress, logs and errors; stdout carries only data."""

from __future__ import annotations

import sys

_console = None


def err_console():
    """The stderr console (re-made when sys.stderr was replaced, as test runners do)."""
    global _console
    if _console is None or _console.file is not sys.stderr:
        from rich.console import Console
        _console = Console(file=sys.stderr, stderr=True)
    return _console


def stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False
